"""to_inference on captured steps: forward only, dropout gone, batch norm in eval form, one user output;
the result verifies, runs on the interpreter and equals the eager model in eval mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from recir.capture import capture_train_step
from recir.transforms import ConfigError, to_inference, verify
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.4)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.relu(self.bn(self.fc1(x))))
        return self.fc2(F.dropout(h, 0.2, self.training))


def _loss(model, batch):
    logits = model(batch["x"])
    return F.cross_entropy(logits, batch["y"]), logits


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(8, 6, generator=g), "y": torch.randint(0, 3, (8,), generator=g)}


def test_inference_graph_matches_the_eager_model_in_eval_mode():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = capture_train_step(model, opt, _loss, _batch(0))
    state = step.init_state(model, opt)
    for i in range(3):  # train a little: running statistics move away from their init
        state, _ = step(state, _batch(i))
    trained = step.state_dict(state)

    inf = to_inference(step, "aux.0")
    verify(inf)
    report = {"output": "aux.0", "dropouts_removed": 2, "batch_norms_to_eval": 1, "nodes_narrowed": 0}
    assert inf.meta["recir.inference"] == report
    assert [o.name for o in inf.signature.outputs] == ["aux.0"]
    kinds = {s.kind for s in inf.signature.state}
    assert kinds == {"param", "buffer"}, kinds  # no optimizer or rng state left
    targets = {n.target for n in inf.graph.nodes}
    assert torch.ops.aten._native_batch_norm_legit_no_training.default in targets
    assert torch.ops.aten._native_batch_norm_legit_functional.default not in targets

    inf_state = [trained[s.name] for s in inf.signature.state]
    batch = _batch(7)
    _, (logits,) = inf(inf_state, batch)
    _, (again,) = inf(inf_state, batch)
    torch.testing.assert_close(logits, again, rtol=0, atol=0)  # no randomness left

    eager = Net()
    eager.load_state_dict(
        {k.split(":", 1)[1]: v for k, v in trained.items() if k.startswith(("param:", "buffer:"))}
    )
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, eager(batch["x"]), rtol=1e-5, atol=1e-6)


def test_inference_output_must_exist():
    model = Net()
    step = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch(0))
    with pytest.raises(
        ConfigError, match=r"no user output 'logits'; the step's outputs are \['loss', 'aux.0'\]"
    ):
        to_inference(step, "logits")
    assert to_inference(step).signature.outputs[0].name == "aux.0"  # default: the first after the loss
