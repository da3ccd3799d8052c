"""Multi-process JAX (the multi-host layout): two processes with 4 host devices each join one 8-device mesh
through ``recir.lower_tpu.initialize_distributed`` and train a TorchRec model under a hybrid plan (dense
data-parallel, tables row-wise); the gathered state matches the single-process interpreter.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.tpu,
    # run once, in the tpu session (8 host devices), not also in the cpu session; it starts its own processes
    pytest.mark.skipif(
        "device_count=8" not in os.environ.get("XLA_FLAGS", ""),
        reason="the tpu nox session runs it (XLA_FLAGS=--xla_force_host_platform_device_count=8)",
    ),
]

WORKER = Path(__file__).with_name("_lower_tpu_multiprocess_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(tmp_path: Path, nproc: int = 2) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
    port = _port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(nproc), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{text[-4000:]}"
    return [json.loads((tmp_path / f"process{i}.json").read_text()) for i in range(nproc)]


def test_two_processes_train_one_mesh_like_one_process(tmp_path):
    results = _run_job(tmp_path)
    for i, r in enumerate(results):
        assert (r["index"], r["count"]) == (i, 2)
        assert (r["global_devices"], r["local_devices"]) == (8, 4)
        # each process holds only its half of a row-wise table
        assert not r["table_fully_addressable"]
        assert r["table_local_bytes"] * 2 == r["table_bytes"]
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) <= 1e-5 + 1e-4 * abs(b), (r["losses"], r["ref_losses"])
        assert any(s.startswith("optim:") for s in r["slots"])  # optimizer state is compared too
        bad = {k: v for k, v in r["state_diffs"].items() if v > 1e-5}
        assert not bad, bad
    assert results[0]["losses"] == results[1]["losses"]  # one SPMD program: same replicated loss
