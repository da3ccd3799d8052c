"""`torchrun --nproc-per-node 2 -m recir.dlrmv3 train --target gpu --parallel dp`, launched as a user would:
each rank's program compiled by Inductor (CPU device, gloo), trains like one eager process on the same
global batches (losses step by step, then every parameter and optimizer-state slot of the checkpoint)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _dlrmv3_output import messages
from _dlrmv3_workers import matches_one_eager_process

# Tiny sizes; several candidates per sample (the ranks' halves differ in count and longest sequence).
FLAGS = dict(batch_size=8, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=4,
             hash_size=200, num_train_batches=3, log_every=1, num_eval_batches=1, input_dropout=0.0,
             layer_dropout=0.0, seed=1, num_threads=1)  # fmt: skip
STEPS = int(FLAGS["num_train_batches"])


def _torchrun() -> list[str]:
    script = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.slow
def test_dlrmv3_torchrun_two_compiled_ranks_train_like_one_eager_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [f"--{k}={v}" for k, v in FLAGS.items()]
    cmd = [*_torchrun(), "--standalone", "--nproc-per-node", "2", "-m", "recir.dlrmv3", "train",
           "--target", "gpu", "--parallel", "dp", f"--checkpoint_dir={ckpt}", f"--checkpoint_every={STEPS}",
           *args]  # fmt: skip
    # One OpenMP thread per rank; RECIR_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR pass through, so both ranks
    # (and later runs) share the compile caches: rank 0 compiles, rank 1 reads its artifacts.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, check=False)
    out = run.stdout
    assert run.returncode == 0, (out + run.stderr)[-4000:]
    compiled = [line for line in messages(out) if line.startswith("train step compiled in")]
    assert len(compiled) == 1, out  # rank 0 logs, rank 1 stays silent
    assert "recir.lower_gpu.compile" in compiled[0] and "2 rank(s), parallel dp" in compiled[0], compiled
    losses = [
        float(x) for x in re.findall(r"^epoch \d+ step \d+ loss (\S+)", "\n".join(messages(out)), flags=re.M)
    ]

    matches_one_eager_process(tmp_path, FLAGS, losses, ckpt / f"step-{STEPS}", state_rtol=1e-4)
