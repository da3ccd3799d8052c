"""Rank bodies for the multi-process tests, in a module of their own: spawned children import the
function by its module's name, which must not depend on how pytest named the test file."""

from __future__ import annotations

import recir.lower_gpu as lg
import torch
import torch.distributed as dist
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph


def in_turn_worker(rank: int, world: int, port: int, log: str, same_program: bool) -> None:
    import os
    import pathlib
    import time

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("LOCAL_RANK", None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batch = mlp_batch(0) if same_program or rank == 0 else {k: v[:3] for k, v in mlp_batch(0).items()}
        step = sgd_step_graph(TinyMLP(), mse_loss, batch)
        path = pathlib.Path(log)
        with lg.compile_in_turn(step):
            with path.open("a") as f:
                f.write(f"{rank}-enter\n")
            if rank == 0 and not same_program:  # different programs: rank 1 is inside at the same time
                deadline = time.monotonic() + 120
                while "1-enter" not in path.read_text():
                    assert time.monotonic() < deadline, "rank 1 never entered: ranks compiled in turn"
                    time.sleep(0.05)
            with path.open("a") as f:
                f.write(f"{rank}-exit\n")
    finally:
        dist.destroy_process_group()
