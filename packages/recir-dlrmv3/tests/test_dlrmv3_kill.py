"""The kill test: SIGKILL a training run at seeded random points (steps and checkpoint writes), resume
it each time, and the final parameters and optimizer state equal an uninterrupted run's exactly."""

import json
import random
import subprocess
import sys
from pathlib import Path

import torch
from recir.dlrmv3 import TrainOptions, load_checkpoint, train

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1)  # fmt: skip
STEPS = 30
DRIVER = Path(__file__).with_name("_dlrmv3_kill.py")


def _schedule(seed: int) -> list[tuple[str, int, float]]:
    """12 kills: 5 inside a checkpoint write, 7 a random time after a random step."""
    rng = random.Random(seed)
    kinds = ["write"] * 5 + ["step"] * 7
    rng.shuffle(kinds)
    return [(k, rng.randint(1, 2), 0.0) if k == "write" else (k, rng.randint(1, 3), rng.uniform(0, 0.25))
            for k in kinds]  # fmt: skip


def test_dlrmv3_sigkill_at_random_points_then_resume_is_exact(tmp_path):
    ckpt = tmp_path / "killed"
    argv = [
        "train",
        "--target",
        "eager",
        "--num_train_batches",
        str(STEPS),
        "--log_every",
        "1",
        "--eval_every",
        "0",
        "--checkpoint_dir",
        str(ckpt),
        "--checkpoint_every",
        "1",
        "--resume",
    ]
    argv += [f"--{k}={v}" for k, v in TINY.items()]  # fmt: skip
    schedule = _schedule(seed=13)
    spec = {"argv": argv, "checkpoint_dir": str(ckpt), "schedule": schedule}
    proc = subprocess.run([sys.executable, str(DRIVER), json.dumps(spec)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    attempts = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(attempts) == len(schedule) + 1, proc.stdout
    print(*attempts, sep="\n")
    for a, after in zip(attempts, attempts[1:]):  # every scheduled attempt died by SIGKILL, mid-run
        assert a["killed"] and a["signal"] == 9, a
        if a["kind"] == "write":  # killed inside the write of step K: its .tmp-step-K is on disk, and
            assert a["tmp_dirs"] == [a["writing"]], a  # the next attempt resumes from step K - 1
            before = int(a["writing"].removeprefix(".tmp-step-")) - 1
            assert after["resumed_from"] == (before or None), (
                a,
                after,
            )  # None: step 1's write, a fresh start
    resumed = [a["resumed_from"] or 0 for a in attempts]
    assert resumed == sorted(resumed) and resumed[-1] > 0 and len(set(resumed)) >= 8, resumed
    assert attempts[-1]["exit"] == 0 and attempts[-1]["signal"] is None, attempts[-1]
    assert sum(a["kind"] == "write" for a in attempts) >= 4

    full = tmp_path / "full"
    train(TrainOptions(**TINY, num_train_batches=STEPS, log_every=100, checkpoint_dir=str(full), checkpoint_every=1),
          log=lambda _: None)  # fmt: skip
    got, got_meta = load_checkpoint(ckpt / f"step-{STEPS}")
    want, want_meta = load_checkpoint(full / f"step-{STEPS}")
    assert got_meta["step"] == want_meta["step"] == STEPS
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(got[k], want[k])]
    assert not different, different  # parameters, optimizer state, RNG and data position: bit for bit
