"""`recir-dlrmv3 train --target tpu --mesh data=8` as a multi-process JAX job, launched as on a multi-host
slice: two processes with 4 host devices each (`--coordinator --num_processes --process_id`) train one
GSPMD program over the 8-device mesh like one process; process 0 logs and writes the checkpoint."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from _dlrmv3_workers import matches_one_eager_process
from recir.dlrmv3 import TrainOptions
from recir.transforms import ConfigError

FLAGS = dict(batch_size=8, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=4,
             hash_size=200, num_train_batches=3, log_every=1, num_eval_batches=1, input_dropout=0.0,
             layer_dropout=0.0, seed=1)  # fmt: skip
STEPS = int(FLAGS["num_train_batches"])
# Run once, in the tpu session, not also in the cpu session (where JAX has one device).
_ONE_DEVICE = "device_count=8" not in os.environ.get("XLA_FLAGS", "")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.tpu
@pytest.mark.skipif(
    _ONE_DEVICE, reason="the tpu nox session runs it (8 host devices); it starts its own JAX processes"
)
def test_dlrmv3_two_jax_processes_train_like_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    port = _port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    cmd = [sys.executable, "-m", "recir.dlrmv3", "train", "--target", "tpu", "--mesh", "data=8",
           f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--checkpoint_dir={ckpt}",
           f"--checkpoint_every={STEPS}", *(f"--{k}={v}" for k, v in FLAGS.items())]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*cmd, f"--process_id={i}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for i in range(2)
    ]
    outs = []
    try:
        outs = [p.communicate(timeout=480) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{(out + err)[-4000:]}"
    out0, out1 = outs[0][0], outs[1][0]
    # process 0 logs, process 1 stays silent. Gloo's C++ threads print connection lines to the same
    # stdout and may interleave with ours, so the patterns are not anchored at line starts.
    assert not re.search(r"train step compiled|epoch \d+ step|checkpoint step|done: target", out1), out1
    assert "mesh {'data': 8} over 2 process(es)" in out0, out0
    losses = [float(x) for x in re.findall(r"epoch \d+ step \d+ loss (\d+\.\d+)", out0)]

    # process 0 wrote the global state, gathered from both processes' devices
    matches_one_eager_process(tmp_path, FLAGS, losses, ckpt / f"step-{STEPS}", state_rtol=1e-3)


def test_dlrmv3_multihost_flags_need_the_tpu_mesh():
    with pytest.raises(ConfigError, match="multi-process JAX job on the TPU path"):
        TrainOptions(target="gpu", coordinator="127.0.0.1:1234").check()
    with pytest.raises(ConfigError, match="--mesh data=N"):
        TrainOptions(target="tpu", num_processes=2, process_id=0).check()
    with pytest.raises(ConfigError, match="--num_processes must be >= 1"):
        TrainOptions(target="tpu", mesh="data=8", num_processes=0).check()
