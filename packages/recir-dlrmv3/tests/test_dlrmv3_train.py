"""`train` on the eager target: it learns the debug data, logs, writes TensorBoard events, resumes
exactly after a SIGKILL, and every bad input is a clear error with a non-zero exit."""

import dataclasses
import io
import logging
import math
import re
import signal
import subprocess
import sys

import pytest
from _dlrmv3_events import hparams, run_dirs, scalars, text
from _dlrmv3_output import LOG_LINE, messages
from recir.dlrmv3 import TrainOptions, train
from recir.dlrmv3._cli import main

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1)  # fmt: skip
_CLI = [sys.executable, "-m", "recir.dlrmv3"]


def test_dlrmv3_eager_training_learns_the_debug_data(tmp_path):
    lines: list[str] = []
    opts = TrainOptions(num_train_batches=400, embedding_dim=32, num_layers=1, uih_len=16, batch_size=16,
                        log_every=100, num_eval_batches=8, num_threads=1, tensorboard_dir=str(tmp_path / "tb"))  # fmt: skip
    result = train(opts, log=lines.append)
    first, last = sum(result.losses[:50]) / 50, sum(result.losses[-50:]) / 50
    assert last < 0.85 * first, (first, last)
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert result.metrics["vvp100/auc"] > 0.7, result.metrics
    assert result.metrics["vvp100/ne"] < 0.95
    assert sum("train step compiled in" in x for x in lines) == 1
    assert [x.split(" loss")[0] for x in lines if x.startswith("epoch")] == [
        f"epoch 0 step {s}" for s in (100, 200, 300, 400)
    ]
    (run,) = run_dirs(tmp_path / "tb")  # one sub-folder per run, named by its start time and target
    assert run.parent == tmp_path / "tb" and re.fullmatch(r"\d{8}-\d{6}-eager", run.name), run
    assert f"tensorboard: {run}" in lines
    tb = scalars(run)
    assert [v for _, v in tb["train/loss"]] == pytest.approx(result.losses, rel=1e-6)
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 401))  # the console's step numbers
    for k, v in result.metrics.items():
        assert tb[f"eval/{k}"] == [(400, pytest.approx(v, rel=1e-6))], k
    logged = [x for x in lines if x.startswith("epoch")]
    assert [s for s, _ in tb["perf/ms_per_step"]] == [100, 200, 300, 400]
    assert [round(v, 1) for _, v in tb["perf/ms_per_step"]] == [
        float(x.split("(")[1].split()[0]) for x in logged
    ]
    assert [v for _, v in tb["perf/samples_per_second"]] == pytest.approx(
        [16_000 / v for _, v in tb["perf/ms_per_step"]], rel=1e-5
    )
    assert tb["perf/compile_seconds"] == [(1, pytest.approx(result.compile_seconds, abs=1e-6))]
    assert tb["train/lr/dense"] == [(s, pytest.approx(1e-3)) for s in (100, 200, 300, 400)]
    assert tb["train/lr/tables"] == [(s, pytest.approx(1e-3)) for s in (100, 200, 300, 400)]
    config, metric_tags = hparams(run)
    assert config["embedding_dim"] == 32 and config["target"] == "eager" and config["mesh"] == "none"
    assert config["lr"] == pytest.approx(1e-3) and set(config) == {f.name for f in dataclasses.fields(opts)}
    assert sorted(metric_tags) == sorted(f"eval/{k}" for k in result.metrics)
    assert "| embedding_dim | 32 |" in text(run, "config")
    printed_waste = float(lines[-1].split("padding waste ")[1].split("%")[0])
    assert [(s, round(100 * v, 1)) for s, v in tb["train/padding_waste"]] == [(400, printed_waste)]


def _run(args: list[str], **kw) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    return subprocess.run(_CLI + args, capture_output=True, text=True, timeout=300, **kw)


def test_dlrmv3_cli_train_prints_the_contract_lines(tmp_path):
    args = ["train", "--target", "eager", "--dataset", "debug", "--batch_size", "4", "--num_workers", "2",
            "--num_train_batches", "6", "--embedding_dim", "64", "--num_layers", "1", "--uih_len", "16",
            "--num_candidates", "4", "--hash_size", "1000", "--log_every", "1", "--num_threads", "1",
            "--num_eval_batches", "2", "--tensorboard_dir", str(tmp_path / "tb")]  # fmt: skip
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(LOG_LINE.match(line) for line in proc.stdout.splitlines()), proc.stdout  # time, level, message
    out = messages(proc.stdout)
    assert sum(line.startswith("train step compiled in ") for line in out) == 1
    steps = [line for line in out if line.startswith("epoch 0 step ")]
    assert [s.split()[3] for s in steps] == ["1", "2", "3", "4", "5", "6"]
    assert all(s.endswith("ms/step)") for s in steps)
    assert (
        out[-1].startswith("done: target eager, 6 steps")
        and "samples/s" in out[-1]
        and "vvp100/auc" in out[-1]
    )
    assert "[" not in proc.stderr  # no progress bar when stderr is not a terminal
    # the DataLoader workers feed exactly the batches of the inline loader
    inline = train(TrainOptions(**{**TINY, "batch_size": 4, "embedding_dim": 64, "uih_len": 16, "num_candidates": 4,
                                   "hash_size": 1000, "num_train_batches": 6, "log_every": 10}), log=lambda _: None)  # fmt: skip
    printed = [float(s.split()[5]) for s in steps]
    assert printed == pytest.approx(inline.losses, abs=2e-6)
    (run,) = run_dirs(tmp_path / "tb")
    tb = scalars(run)
    assert [v for _, v in tb["train/loss"]] == pytest.approx(printed, abs=2e-6)
    assert {"eval/vvp100/auc", "train/padding_waste"} <= set(tb)


def test_dlrmv3_resume_after_sigkill_reproduces_the_losses(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = ["train", "--target", "eager", "--num_train_batches", "200", "--log_every", "1", "--checkpoint_dir", str(ckpt),
            "--checkpoint_every", "3"] + [f"--{k}={v}" for k, v in TINY.items()]  # fmt: skip
    proc = subprocess.Popen(_CLI + base, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if " INFO checkpoint step 6" in line:
                break
        else:
            pytest.fail("the run ended before writing checkpoint 6")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    steps = 12
    opts = TrainOptions(
        **TINY, num_train_batches=steps, log_every=100, checkpoint_dir=str(ckpt), resume="latest"
    )
    resumed = train(opts, log=lambda _: None)
    assert resumed.start_step >= 6 and len(resumed.losses) == steps - resumed.start_step
    full = train(TrainOptions(**TINY, num_train_batches=steps, log_every=100), log=lambda _: None)
    assert (
        resumed.losses == full.losses[resumed.start_step :]
    )  # exact: dropout RNG and data position restored
    assert resumed.metrics == full.metrics


def test_dlrmv3_bad_inputs_are_clear_errors(tmp_path, capsys, monkeypatch):
    assert main(["train", "--batch_size", "-1"]) == 2
    assert "error: --batch_size must be >= 1, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["train", "--dataset", "criteo"])
    assert e.value.code == 2 and "invalid choice: 'criteo'" in capsys.readouterr().err
    assert main(["train", "--dataset", "movielens-1m", "--data_dir", str(tmp_path)]) == 2
    assert f"no sasrec_format.csv found; tried {tmp_path}/sasrec_format.csv" in capsys.readouterr().err
    assert main(["train", "--checkpoint_every", "2"]) == 2
    assert "--checkpoint_every needs --checkpoint_dir" in capsys.readouterr().err

    import sys

    monkeypatch.setitem(sys.modules, "recir.lower_gpu", None)  # `import recir.lower_gpu` fails
    assert (
        main(
            ["train", "--target", "gpu", "--num_train_batches", "1", "--host_memory", "release"]
            + [f"--{k}={v}" for k, v in TINY.items()]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "error: --target gpu needs recir.lower_gpu" in err and "--target eager" in err


def test_dlrmv3_console_script_exits_non_zero_on_errors(tmp_path, capsys):
    proc = _run(["train", "--batch_size", "-1"])
    assert proc.returncode == 2 and "error: --batch_size must be >= 1" in proc.stderr
    assert (
        main(
            ["prepare", "--dataset", "movielens-1m", "--raw_dir", str(tmp_path), "--data_dir", str(tmp_path)]
        )
        == 2
    )
    assert "no MovieLens ratings found" in capsys.readouterr().err
    for cmd in ("train", "parity", "prepare"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0 and "usage: recir-dlrmv3 " + cmd in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["train", "parity"])
def test_dlrmv3_help_imports_no_torch(cmd):
    # --help lists the flags without importing torch (the default --target is resolved after parsing)
    code = (
        f"import sys\nfrom recir.dlrmv3._cli import main\ntry:\n    main(['{cmd}', '--help'])\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "--num_train_batches" in out and "--optimizer {reference,adam,adagrad}" in out.replace("\n", " ")
    assert out.splitlines()[-1] == "False"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--lr", "0"], "error: --lr must be a finite number > 0, got 0.0"),
        (["train", "--lr", "-1"], "error: --lr must be a finite number > 0, got -1.0"),
        (["train", "--lr", "nan"], "error: --lr must be a finite number > 0, got nan"),
        (["train", "--sparse_lr", "0"], "error: --sparse_lr must be a finite number > 0, got 0.0"),
        (["train", "--eval_every", "-1"], "error: --eval_every must be >= 0, got -1"),
        (["train", "--input_dropout", "1"], "error: --input_dropout must be in [0, 1), got 1.0"),
        (["parity", "--atol", "-1"], "error: --atol must be >= 0, got -1.0"),
        (["parity", "--lr", "0"], "error: --lr must be a finite number > 0, got 0.0"),
        (["parity", "--steps", "0"], "error: --num_train_batches must be >= 1, got 0"),
        (["parity", "--num_train_batches", "0"], "error: --num_train_batches must be >= 1, got 0"),
        (
            ["train", "--target", "tpu", "--cuda_graphs"],
            "error: --cuda_graphs is the single-process GPU path's flag (got --target tpu, --parallel none). "
            "Fix: --target gpu without --parallel, on a CUDA machine.",
        ),
        (
            ["train", "--target", "gpu", "--attention_kernel", "triton"],
            "error: --attention_kernel triton runs the GPU path's attention op as RecIR's Triton kernels (got "
            "--target gpu, --recompute none); without --recompute attention the attention is plain ATen in the "
            "step, not the op. Fix: --target gpu --recompute attention on a CUDA machine, or drop "
            "--attention_kernel.",
        ),
    ],
)
def test_dlrmv3_bad_numeric_flags_are_one_error_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [message], err


@pytest.fixture
def _restore_logging():  # type: ignore[no-untyped-def]
    # main() and setup_logging() configure the root logger: give the next tests the one they had
    root, ours = logging.getLogger(), logging.getLogger("recir.dlrmv3")
    before = (list(root.handlers), root.level, ours.level)
    yield
    for handler in root.handlers:
        if handler not in before[0]:
            handler.close()
    root.handlers[:] = before[0]
    root.setLevel(before[1])
    ours.setLevel(before[2])


@pytest.mark.usefixtures("_restore_logging")
def test_dlrmv3_version_and_log_flags(tmp_path, capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"recir-dlrmv3 {version('recir-dlrmv3')}"

    log_file = tmp_path / "run.log"
    args = [
        "train",
        "--target",
        "eager",
        "--num_train_batches",
        "2",
        "--log_every",
        "1",
        "--log_file",
        str(log_file),
    ]
    args += [f"--{k}={v}" for k, v in TINY.items()]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert messages(out)[0].startswith("train step compiled in ") and messages(out)[-1].startswith("done:")
    assert [m.split(" loss")[0] for m in messages(out)[1:3]] == ["epoch 0 step 1", "epoch 0 step 2"]
    assert log_file.read_text().splitlines() == out.splitlines()  # the same lines, time-stamped
    assert main([*args, "--log_level", "warning"]) == 0
    assert capsys.readouterr().out == ""  # INFO lines hidden; the file gets only what the console gets
    assert log_file.read_text().splitlines() == out.splitlines()
    assert main([*args, "--log_file", str(tmp_path / "no" / "such" / "dir.log")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --log_file {tmp_path}/no/such/dir.log: cannot open it")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.usefixtures("_restore_logging")
@pytest.mark.parametrize("terminal", [True, False])
def test_dlrmv3_progress_bar_on_a_terminal_only(terminal, monkeypatch):
    from recir.dlrmv3._logs import Progress, log_info, setup_logging

    # On a terminal stdout (log lines) and stderr (the bar) reach one screen: one stream here.
    screen = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    setup_logging("info")
    bar = Progress(total=4, initial=1)
    for done in (2, 3):
        bar.update(done, loss=0.25)
        log_info(f"line {done}")
    bar.close()
    shown = screen.getvalue()
    if terminal:  # the bar: position, elapsed<ETA, rate and the last loss
        assert re.search(r"3/4 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(step/s|s/step), loss 0\.2500\]", shown), shown
        # each log line starts on a cleared line (tqdm's logging redirect), never glued to the bar
        for done in (2, 3):
            assert re.search(rf"[\r\n]\S+ \S+ INFO line {done}\n", shown), shown
    else:  # plain log lines only
        assert messages(shown) == ["line 2", "line 3"] and len(shown.splitlines()) == 2, shown


def test_dlrmv3_cuda_graphs_flag_reaches_the_gpu_lowering():
    from recir.dlrmv3._train import gpu_options
    from recir.lower_gpu import GPUOptions

    assert gpu_options(TrainOptions(target="gpu")) is None
    assert gpu_options(TrainOptions(target="gpu", cuda_graphs=True)) == GPUOptions(cuda_graphs=True)


def test_dlrmv3_attention_kernel_flag_reaches_the_gpu_lowering():
    from recir.dlrmv3._train import gpu_options
    from recir.lower_gpu import GPUOptions

    opts = TrainOptions(target="gpu", recompute="attention", attention_kernel="triton")
    assert gpu_options(opts) == GPUOptions(hstu_attention="triton")
    assert gpu_options(TrainOptions(target="gpu", recompute="attention")) is None  # inductor: the default
