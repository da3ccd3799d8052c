"""`train --profile DIR`: the TPU path's time per StepGraph region (module scope x phase) from a JAX
profiler trace; other targets a torch profiler trace and table."""

from __future__ import annotations

import pytest
from recir.dlrmv3 import TrainOptions, train

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip


@pytest.mark.tpu
def test_dlrmv3_profile_tpu_prints_time_per_region(tmp_path):
    lines: list[str] = []
    opts = TrainOptions(**TINY, target="tpu", num_train_batches=4, log_every=4, profile=str(tmp_path / "p"),
                        profile_steps=2)  # fmt: skip
    train(opts, log=lines.append)
    start = next(i for i, x in enumerate(lines) if x.startswith("profile of 2 step(s) (steps 2-3)"))
    table = lines[start + 1 :]
    assert table[0].split()[:3] == ["region", "phase", "ms/step"]
    regions = {tuple(x.split()[:2]) for x in table[1:] if x.split() and not x.startswith(("total", "("))}
    assert ("layers.0", "forward") in regions or ("layers.0.uvqk", "forward") in regions
    assert any(p == "backward" for _, p in regions) and any(p == "optimizer" for _, p in regions)
    total = next(x for x in table if x.startswith("total"))
    assert float(total.split()[-1]) > 0
    assert list((tmp_path / "p").glob("**/*.xplane.pb"))


def test_dlrmv3_profile_eager_writes_a_torch_trace(tmp_path):
    lines: list[str] = []
    opts = TrainOptions(**TINY, target="eager", num_train_batches=3, log_every=3, profile=str(tmp_path / "p"))
    train(opts, log=lines.append)
    assert any(x.startswith("profile of 2 step(s)") for x in lines)  # the run ended inside the window
    assert any("aten::mm" in x or "aten::addmm" in x for x in lines)
    assert (tmp_path / "p" / "trace.json").stat().st_size > 0


@pytest.mark.slow
def test_dlrmv3_profile_gpu_path_in_pieces_prints_time_per_region(tmp_path):
    lines: list[str] = []
    opts = TrainOptions(**{**TINY, "num_layers": 2}, target="gpu", compile_regions="repeated", num_train_batches=3,
                        log_every=3, profile=str(tmp_path / "p"), profile_steps=2)  # fmt: skip
    train(opts, log=lines.append)
    start = next(
        i for i, x in enumerate(lines) if x.startswith("time per region (the GPU path's compiled pieces")
    )
    table = lines[start + 1 :]
    assert table[0].split()[:3] == ["region", "phase", "ms/step"]
    end = next(i for i, x in enumerate(table) if x.startswith("total"))
    rows = {tuple(x.split()[:2]): float(x.split()[2]) for x in table[1:end]}
    for phase in ("forward", "backward", "optimizer"):  # each STU layer in each phase is a piece of its own
        assert rows[("layers.0", phase)] > 0 and rows[("layers.1", phase)] > 0, phase
    assert any(scope == "(glue)" for scope, _ in rows)
    assert float(table[end].split()[-1]) > 0
    assert any("aten::" in x for x in lines[:start])  # the operator table still comes first
