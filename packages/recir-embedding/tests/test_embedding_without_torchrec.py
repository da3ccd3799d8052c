"""TorchRec and FBGEMM are optional: a plain nn.EmbeddingBag model captures with recir.embedding's
overrides, gets sparse row-wise updates and trains with neither importable (a fresh process where
both imports fail), and the torchrec/fbgemm backends name the extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = r"""
import sys
sys.modules["torchrec"] = None  # import torchrec -> ImportError
sys.modules["fbgemm_gpu"] = None
import torch
from torch import nn
import recir.embedding as re
from recir.capture import capture_train_step

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.EmbeddingBag(50, 8, mode="sum")
        self.fc = nn.Linear(8, 1)
    def forward(self, ids, offsets):
        return self.fc(self.e(ids, offsets)).squeeze(-1)

def loss_fn(m, b):
    return ((m(b["ids"], b["offsets"]) - b["y"]) ** 2).mean()

torch.manual_seed(0)
m = M()
opt = torch.optim.Adagrad(m.parameters(), lr=0.1)
batch = {"ids": torch.randint(0, 50, (12,)), "offsets": torch.tensor([0, 3, 7, 9]), "y": torch.randn(4)}
step = re.prepare_for_lowering(capture_train_step(m, opt, loss_fn, batch, overrides=re.overrides()), target="gpu", device="cpu")
state = step.init_state(m, opt)
for _ in range(3):
    state, (loss,) = step(state, batch)
print("sparsified", step.meta["recir.embedding"]["sparsify"]["sparsified"])
print("loss", float(loss))
for backend, extra in (("torchrec", "recir-embedding[torchrec]"), ("fbgemm", "recir-embedding[fbgemm-cpu]")):
    try:
        re.prepare_for_lowering(step, backend=backend, target="gpu", device="cpu")
        print(backend, "NO ERROR")
    except ImportError as e:
        print(backend, "names", extra, extra in str(e))
print("torchrec loaded:", "torchrec" in sys.modules and sys.modules["torchrec"] is not None)
"""


@pytest.mark.smoke
def test_plain_model_trains_without_torchrec_and_fbgemm():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "sparsified ['param:e.weight']" in lines
    assert "torchrec names recir-embedding[torchrec] True" in lines
    assert "fbgemm names recir-embedding[fbgemm-cpu] True" in lines
    assert "torchrec loaded: False" in lines
