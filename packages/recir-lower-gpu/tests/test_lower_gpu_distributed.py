"""Collectives in the graph run on torch.distributed: refused without a process group, run with one.

A one-rank gloo group in this process is enough to lower and run functional collectives on CPU;
multi-rank runs (torchrun, nccl) use the same path.
"""

from __future__ import annotations

import pytest
import recir.lower_gpu as lg
import torch
import torch.distributed as dist
from _lower_gpu_ranks import in_turn_worker
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph
from recir.transforms import ConfigError


def _all_reduce_loss(model, batch):
    x = torch.ops._c10d_functional.all_reduce(batch["x"], "sum", "0")
    x = torch.ops._c10d_functional.wait_tensor(x)
    return mse_loss(model, {"x": x, "y": batch["y"]})


def test_collectives_need_a_process_group_then_run_on_it(lower_gpu_cache_dir):
    torch.manual_seed(0)
    model = TinyMLP()
    step = sgd_step_graph(model, _all_reduce_loss, mlp_batch(0))
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="no torch.distributed process group is initialised") as info:
        lg.compile(step, device="cpu")
    assert "_c10d_functional.all_reduce" in str(info.value) and "init_process_group" in str(info.value)
    with pytest.raises(ConfigError, match="plan must be a recir.distributed.ShardingPlan"):
        lg.compile(step, plan=object(), device="cpu")

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert dist.group.WORLD.group_name == "0"
        compiled = lg.compile(step, device="cpu", options=lg.GPUOptions(cache_dir=lower_gpu_cache_dir))
        state, ref = compiled.init_state(model), step.init_state(model)
        for i in range(2):
            state, out = compiled(state, mlp_batch(i))
            ref, ref_out = step(ref, mlp_batch(i))
            torch.testing.assert_close(out[0], ref_out[0], rtol=1e-5, atol=1e-6)
        for got, want in zip(state, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("same_program", [True, False], ids=["same-program", "different-programs"])
def test_compile_in_turn_orders_identical_programs_only(tmp_path, same_program):
    """Identical programs: rank 0 compiles (fills the shared cache) before rank 1 enters; different
    programs (sharded tables) compile at once."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "order.txt"
    log.touch()
    mp.spawn(in_turn_worker, args=(2, port, str(log), same_program), nprocs=2, join=True)
    lines = log.read_text().split()
    if same_program:
        assert lines == ["0-enter", "0-exit", "1-enter", "1-exit"]
    else:
        assert lines.index("1-enter") < lines.index("0-exit")
