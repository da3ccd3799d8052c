"""Importing recir.lower_tpu (and so torchax, which names torch's PrivateUse1 device "jax") leaves
torch.compile working in the same process (from torch 2.10 Dynamo asks the available accelerator for its
stream, which the "jax" device cannot answer)."""

from __future__ import annotations

import subprocess
import sys

_CHILD = """
import torch
import recir.lower_tpu  # noqa: F401
assert not torch.accelerator.is_available(), "the 'jax' device must report itself unavailable"
assert torch.equal(torch.compile(lambda x: x * 2 + 1)(torch.ones(5)), torch.full((5,), 3.0))
print("ok")
"""


def test_torch_compile_works_after_importing_lower_tpu():
    done = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
