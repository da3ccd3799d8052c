"""Makes this folder's helper modules (``_distributed_models``, ``_distributed_workers``) importable."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


import pytest  # noqa: E402


@pytest.fixture
def world1():
    """A one-process gloo group in the test process: collectives run (as identities) in the interpreter."""
    import torch.distributed as dist
    from _distributed_workers import free_port

    if dist.is_initialized():
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()
