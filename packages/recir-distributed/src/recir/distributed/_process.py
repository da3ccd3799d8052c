"""The process group a distributed step runs in: torchrun's, or a one-process group for a plain launch."""

from __future__ import annotations

import os
import socket

import torch


def setup_process_group() -> tuple[int, int]:
    """(rank, world size) of the default torch.distributed process group, initialising it if needed.

    Under torchrun (``RANK`` and ``MASTER_ADDR`` set) it joins torchrun's group: NCCL with this process's
    ``LOCAL_RANK`` as the CUDA device when CUDA is present, gloo otherwise. Launched without torchrun it
    makes a one-process gloo (or NCCL) group on a free local port, so a distributed program also runs as
    a single process. An already initialised group is used as it is.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()
