"""`python -m recir.examples.dlrmv3.{tpu,gpu}.train`: thin entry points over `recir-dlrmv3 train` (same
flags, same code path, a default --target each), shipped in the recir-dlrmv3 wheel; `train --dry_run`;
the smoke command with the host-side `--embedding_backend cpu`, and its refusal off the TPU path."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from _dlrmv3_commands import ROOT, SMOKE
from _dlrmv3_output import LOG_LINE, messages
from recir.dlrmv3._cli import train_main

PACKAGE = ROOT / "packages" / "recir-dlrmv3"


# issue 16's smoke command verbatim (`cpu`: tables on the host, the dense step through JAX), and with the
# tables in the graph
@pytest.mark.parametrize("backend", ["in_graph", "cpu"])
def test_dlrmv3_tpu_example_runs_the_smoke_command(backend):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "recir.examples.dlrmv3.tpu.train", *SMOKE, "--embedding_backend", backend]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(LOG_LINE.match(line) for line in proc.stdout.splitlines()), proc.stdout
    out = messages(proc.stdout)
    (compiled,) = [line for line in out if line.startswith("train step compiled in ")]
    # the default target of the tpu entry point, and the flag passed through to the lowering
    assert "recir.lower_tpu.compile" in compiled and f"embedding backend {backend}" in compiled, compiled
    steps = [line for line in out if line.startswith("epoch 0 step ")]
    assert [s.split()[3] for s in steps] == ["1", "2", "3", "4", "5", "6"]
    assert all(" loss " in s and s.endswith("ms/step)") for s in steps), steps
    assert out[-1].startswith("done: target tpu, 6 steps"), out[-1]


@pytest.mark.parametrize(("entry", "argv", "target"), [
    ("tpu", [], "tpu"),
    ("gpu", [], "gpu"),
    ("gpu", ["--target", "eager"], "eager"),  # a --target among the flags wins
    ("tpu", ["--target=eager-graph"], "eager-graph"),
])  # fmt: skip
def test_dlrmv3_example_entry_points_default_their_target(entry, argv, target, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "ckpt"
    flags = [*SMOKE, "--dry_run", "--checkpoint_dir", str(ckpt), "--checkpoint_every", "2", "--resume"]
    assert train_main(entry, [*argv, *flags]) == 0
    out = messages(capsys.readouterr().out)
    assert len(out) == 1 and out[0].startswith("dry run: flags valid; DLRMv3 with "), out
    assert out[0].endswith(f"target {target}; nothing trained"), out
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing (no checkpoint directory either)


def test_dlrmv3_dry_run_checks_what_train_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cases = [
        (["--dry_run", "--target", "tpu", "--mesh", "data=4", "--batch_size", "6"],
         "--batch_size 6 (the global batch) does not split over the data-parallel size 4"),
        (["--dry_run", "--target", "tpu", "--parallel", "hybrid"], "--target tpu --parallel needs --mesh"),
        (["--dry_run", "--target", "eager", "--parallel", "dp"], "--parallel / --mesh need the captured step"),
        (["--dry_run", "--dataset", "movielens-1m", "--data_dir", str(tmp_path)], "no sasrec_format.csv found"),
    ]  # fmt: skip
    for argv, says in cases:
        assert train_main("tpu", argv) == 2, argv
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], (argv, err)


def test_dlrmv3_embedding_backend_cpu_is_refused_off_the_tpu_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["--target", "gpu"], ["--target", "eager"]):
        assert train_main("gpu", [*argv, *SMOKE, "--embedding_backend", "cpu"]) == 2
        out, err = capsys.readouterr()
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --embedding_backend cpu "), err
        assert "Fix: --target tpu --embedding_backend cpu" in lines[0], err
        assert "train step compiled" not in out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("uv") is None, reason="building the wheel needs uv")
def test_dlrmv3_wheel_ships_the_example_entry_points(tmp_path):
    proc = subprocess.run(["uv", "build", "--wheel", "--out-dir", str(tmp_path), str(PACKAGE)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("recir_dlrmv3-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for target in ("tpu", "gpu"):
        assert f"recir/examples/dlrmv3/{target}/train.py" in names, sorted(names)
        assert f"recir/examples/dlrmv3/{target}/__init__.py" in names
    # one PEP 420 namespace `recir` across the distributions; `recir.examples` is one too, so that other
    # distributions may ship examples beside these
    assert "recir/__init__.py" not in names and "recir/examples/__init__.py" not in names


# ids "gpu.train", not "gpu": the root conftest skips tests with a `gpu` keyword where no CUDA is
@pytest.mark.parametrize("entry", ["tpu", "gpu"], ids=lambda entry: f"{entry}.train")
def test_dlrmv3_example_help_names_its_target_and_imports_no_torch(entry):
    code = (
        "import runpy, sys\nsys.argv = ['train', '--help']\ntry:\n"
        f"    runpy.run_module('recir.examples.dlrmv3.{entry}.train', run_name='__main__')\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: recir-dlrmv3 train" in out and "--dry_run" in out
    assert f"(default: {entry})" in " ".join(out.split()), out
    assert out.splitlines()[-1] == "False"
