"""`train` on the eager target: it learns the debug data, logs, writes TensorBoard events, resumes
exactly after a SIGKILL, and every bad input is a clear error with a non-zero exit."""

import math
import signal
import subprocess
import sys

import pytest
import torch
from _dlrmv3_events import run_dirs, scalars
from recir.dlrmv3 import TrainOptions, train
from recir.dlrmv3._cli import main

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1)  # fmt: skip
_CLI = [sys.executable, "-m", "recir.dlrmv3"]


@pytest.fixture(autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    # Two cores shared by many jobs: one thread is both faster and deterministic here.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


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
    (run,) = run_dirs(tmp_path / "tb")
    tb = scalars(run)
    assert [v for _, v in tb["train/loss"]] == pytest.approx(result.losses, rel=1e-6)
    assert [s for s, _ in tb["train/loss"]] == list(range(400))
    for k, v in result.metrics.items():
        assert tb[f"eval/{k}"] == [(400, pytest.approx(v, rel=1e-6))], k
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
    out = proc.stdout.splitlines()
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
            if line.startswith("checkpoint step 6"):
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

    import importlib

    real = importlib.import_module

    def no_engine(name, *a, **k):  # type: ignore[no-untyped-def]
        if name == "recir.lower_gpu":
            raise ImportError("No module named 'recir.lower_gpu'")
        return real(name, *a, **k)

    monkeypatch.setattr("recir.dlrmv3._trainers.importlib.import_module", no_engine)
    assert (
        main(
            ["train", "--target", "gpu", "--num_train_batches", "1"] + [f"--{k}={v}" for k, v in TINY.items()]
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
