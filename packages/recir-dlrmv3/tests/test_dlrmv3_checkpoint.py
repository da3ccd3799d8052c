"""Checkpoints through the CLI: a reused --checkpoint_dir is refused (or overwritten on request) and never
loses this run's checkpoints; resumes check the configuration and every slot; damaged checkpoints are one
`error:` line naming the file and the previous checkpoint. Each refusal writes and deletes nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from _dlrmv3_output import messages
from recir.dlrmv3._cli import main

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1, log_every=100)  # fmt: skip


def _train(ckpt: Path, steps: int, every: int, *extra: str, target: str = "eager") -> list[str]:
    flags = {**TINY, "num_train_batches": steps, "checkpoint_every": every, "checkpoint_dir": ckpt}
    return ["train", "--target", target, *(f"--{k}={v}" for k, v in flags.items()), *extra]


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` by relative path -> sha256 (what a refusal must leave untouched)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _steps(root: Path) -> list[str]:
    return sorted((p.name for p in root.glob("step-*")), key=lambda n: int(n.split("-")[1]))


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_dlrmv3_reused_checkpoint_dir_never_loses_the_new_runs_checkpoints(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    assert main(_train(ckpt, 6, 3)) == 0
    assert _steps(ckpt) == ["step-3", "step-6"]
    before = _snapshot(ckpt)
    capsys.readouterr()

    # A fresh run into a directory holding another run's checkpoints: refused, nothing written or deleted
    # (it used to delete its own step-1 and step-2, point `latest` at a deleted step-2, and a later
    # --resume silently loaded the other run's step-6).
    assert main(_train(ckpt, 2, 1)) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1, errors
    assert str(ckpt) in errors[0] and "--resume" in errors[0] and "--overwrite" in errors[0], errors
    assert _snapshot(ckpt) == before

    # --overwrite removes the old run's checkpoints first and says so; this run keeps its own two newest
    assert main(_train(ckpt, 2, 1, "--overwrite")) == 0
    out = capsys.readouterr().out
    assert f"removed 2 checkpoint(s) of a previous run from {ckpt}: step-3, step-6" in out, out
    assert _steps(ckpt) == ["step-1", "step-2"]
    assert (ckpt / "latest").read_text().strip() == "step-2"

    # --resume continues this run (from step-2, not the old step-6)
    assert main(_train(ckpt, 3, 1, "--resume")) == 0
    assert f"resumed from step 2 ({ckpt / 'step-2'})" in capsys.readouterr().out
    assert _steps(ckpt) == ["step-2", "step-3"]


def test_dlrmv3_rotation_keeps_the_newest_written_checkpoints(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    assert main(_train(ckpt, 6, 2, "--keep_checkpoints", "3")) == 0
    assert _steps(ckpt) == ["step-2", "step-4", "step-6"]
    # Resume from the older step-2 and write steps 3, 4 and 5 again: the newest written three are kept
    # (step-6, a step of the abandoned continuation, is older by write order), and `latest` names step-5.
    assert main(_train(ckpt, 5, 1, "--resume", str(ckpt / "step-2"), "--keep_checkpoints", "3")) == 0
    assert _steps(ckpt) == ["step-3", "step-4", "step-5"]
    assert (ckpt / "latest").read_text().strip() == "step-5"
    capsys.readouterr()
    assert main(_train(ckpt, 6, 1, "--keep_checkpoints", "0")) == 2
    assert _errors(capsys.readouterr().err) == ["error: --keep_checkpoints must be >= 1, got 0"]
    assert main(_train(ckpt, 6, 1, "--resume", "--overwrite")) == 2
    assert "--overwrite starts a new run" in _errors(capsys.readouterr().err)[0]


NO_DROPOUT = ("--input_dropout=0", "--layer_dropout=0")


def test_dlrmv3_resume_refuses_a_checkpoint_that_does_not_fit(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    assert main(_train(ckpt, 2, 2, *NO_DROPOUT)) == 0
    before = _snapshot(ckpt)
    capsys.readouterr()
    # Another size, optimizer and learning rate: one line per difference, each with both values (it used
    # to die in a copy_ traceback, or with --optimizer alone to resume with fresh optimizer state).
    args = _train(ckpt, 4, 2, *NO_DROPOUT, "--resume", "--embedding_dim=32", "--optimizer=adam", "--lr=0.01")
    assert main(args) == 2
    step2 = ckpt / "step-2"
    assert _errors(capsys.readouterr().err) == [
        f"error: --resume {step2}: --embedding_dim is 16 in the checkpoint, 32 in this run. Fix: pass --embedding_dim 16",
        f"error: --resume {step2}: --optimizer is reference in the checkpoint, adam in this run. Fix: pass --optimizer reference",
        f"error: --resume {step2}: --lr is 0.001 in the checkpoint, 0.01 in this run. Fix: pass --lr 0.001",
    ]  # fmt: skip
    assert _snapshot(ckpt) == before

    # The same configuration on the captured step: eager's RNG slot is not the captured step's (which has
    # none without dropout), so the resume names the slot it would drop (that used to pass silently) ...
    assert main(_train(ckpt, 5, 2, *NO_DROPOUT, "--resume", target="eager-graph")) == 2
    assert _errors(capsys.readouterr().err) == [
        f"error: --resume {step2}: slot rng:torch_cpu: the checkpoint has it, this run does not (it would be "
        "dropped). Fix: --allow_fresh_slots 'rng:torch_cpu' (or a pattern such as 'rng:*') to accept that"
    ]
    assert _snapshot(ckpt) == before
    # ... and --allow_fresh_slots accepts them: eager's per-parameter Adam steps become the captured
    # step's shared optim:step, so without dropout the resumed run continues the eager run exactly.
    assert main(_train(ckpt, 5, 5, *NO_DROPOUT, "--resume", "--allow_fresh_slots=rng:*", "--log_every=1", target="eager-graph")) == 0  # fmt: skip
    resumed = [float(x.split()[5]) for x in messages(capsys.readouterr().out) if x.startswith("epoch")]
    assert main(_train(tmp_path / "ref", 5, 0, *NO_DROPOUT, "--log_every=1")) == 0
    reference = [float(x.split()[5]) for x in messages(capsys.readouterr().out) if x.startswith("epoch")]
    assert resumed == pytest.approx(reference[2:], rel=1e-5, abs=1e-6), (resumed, reference)

    # With dropout the captured step has its own RNG slots, which an eager checkpoint lacks
    assert main(_train(tmp_path / "dropout", 2, 2)) == 0
    capsys.readouterr()
    assert main(_train(tmp_path / "dropout", 3, 2, "--resume", target="eager-graph")) == 2
    errors = _errors(capsys.readouterr().err)
    assert [e.split(": ")[2] for e in errors] == ["slot rng:offset", "slot rng:seed", "slot rng:torch_cpu"], (
        errors
    )
    assert "slot rng:offset: this run has it, the checkpoint does not (it would start fresh)" in errors[0]


def test_dlrmv3_damaged_checkpoint_is_one_error_naming_the_file_and_the_previous_one(tmp_path, capsys):
    import subprocess
    import sys

    ckpt = tmp_path / "ck"
    assert main(_train(ckpt, 4, 2)) == 0
    step2, step4 = ckpt / "step-2", ckpt / "step-4"
    fix = f"Fix: resume from the previous checkpoint: --resume {step2}"
    distcp = sorted(step4.glob("*.distcp"))[0]
    data = distcp.read_bytes()
    distcp.write_bytes(data[: len(data) // 2])  # truncated (DCP raised EOFError in a 54-line traceback)
    before = _snapshot(ckpt)
    proc = subprocess.run([sys.executable, "-m", "recir.dlrmv3", *_train(ckpt, 6, 2, "--resume")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {distcp}: damaged ({len(data) // 2} bytes, {len(data)} when written). {fix}"
    ], proc.stderr
    assert _snapshot(ckpt) == before
    capsys.readouterr()

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF  # same size, one bit pattern changed: only the checksum sees it
    distcp.write_bytes(bytes(flipped))
    assert main(_train(ckpt, 6, 2, "--resume", str(step4))) == 2
    assert _errors(capsys.readouterr().err) == [
        f"error: {distcp}: damaged (its sha256 differs from the one written with it). {fix}"
    ]
    distcp.write_bytes(data)

    meta = step4 / "recir.json"
    text = meta.read_text()
    meta.write_text(text[: len(text) // 2])  # JSONDecodeError traceback before
    assert main(_train(ckpt, 6, 2, "--resume")) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(f"error: {meta}: damaged (not valid JSON"), errors
    assert errors[0].endswith(fix)
    meta.write_text(text.replace('"step": 4,', '"step": 40,', 1))  # valid JSON, wrong value
    assert main(_train(ckpt, 6, 2, "--resume")) == 2
    assert _errors(capsys.readouterr().err) == [
        f"error: {meta}: damaged (its contents do not match the checksum written with them). {fix}"
    ]
    meta.write_text(text)
    # the oldest checkpoint has no previous one to name
    (step2 / "recir.json").write_text("{")
    assert main(_train(ckpt, 6, 2, "--resume", str(step2))) == 2
    assert _errors(capsys.readouterr().err)[0].endswith(
        f"Fix: no earlier checkpoint of this run remains in {ckpt}; start anew (--overwrite)"
    )
    # undamaged, the same command resumes
    assert main(_train(ckpt, 6, 2, "--resume")) == 0
    assert f"resumed from step 4 ({step4})" in capsys.readouterr().out
