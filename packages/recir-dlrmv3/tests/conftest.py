"""Makes this folder's helper module (``_dlrmv3_workers``) importable, also in spawned processes, and puts
torch's thread count back after every test (training sets it from ``--num_threads``)."""

import sys
from pathlib import Path

import pytest
import torch

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _restore_torch_threads():  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
