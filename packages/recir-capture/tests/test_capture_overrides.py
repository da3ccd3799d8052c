"""EmbeddingBagOverride: every nn.EmbeddingBag input form maps to recir::embedding_bag with eager numerics."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from recir.capture import CaptureError, capture_train_step, testing
from recir.embedding import EmbeddingBagOverride
from recir.transforms import OVERRIDE_KEY, Override
from torch import nn


class _Bags(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        mode = "mean" if form == "mean_2d" else "sum"
        self.bag = nn.EmbeddingBag(12, 4, mode=mode, include_last_offset=form == "last_offset")
        self.fc = nn.Linear(4, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.form in ("mean_2d", "sum_2d_weights"):
            psw = b["w2"] if self.form == "sum_2d_weights" else None
            e = self.bag(b["ids2"], per_sample_weights=psw)
        elif self.form == "last_offset":
            e = self.bag(b["ids"], torch.cat([b["offsets"], torch.full((1,), 6)]))
        else:
            e = self.bag(b["ids"], b["offsets"])
        return self.fc(e).squeeze(-1)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "ids": torch.randint(0, 12, (6,), generator=g),
        "offsets": torch.tensor([0, 2, 2, 5]),
        "ids2": torch.randint(0, 12, (4, 3), generator=g),
        "w2": torch.rand(4, 3, generator=g),
        "label": torch.randn(4, generator=g),
    }


def _loss(m: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(m(b), b["label"])


@pytest.mark.parametrize("form", ["sum_offsets", "last_offset", "mean_2d", "sum_2d_weights"])
def test_capture_overrides_embedding_bag_forms(form: str) -> None:
    torch.manual_seed(0)
    model = _Bags(form)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, _loss, _batch(), overrides=[EmbeddingBagOverride()])
    ops = [n for n in step.graph.nodes if n.target == torch.ops.recir.embedding_bag.default]
    assert len(ops) == 1 and ops[0].meta[OVERRIDE_KEY] == "recir-embedding-bag"
    assert "param:bag.weight" in step.signature.state_names()
    assert isinstance(model.bag, nn.EmbeddingBag)  # the user's model keeps its module
    grads = testing.captured_gradients(step, step.init_state(model, opt), _batch())
    ref = testing.eager_gradients(model, _loss, _batch())
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_capture_overrides_unsupported_config_traces_natively() -> None:
    model = _Bags("sum_offsets")
    model.bag.padding_idx = 0  # not supported by recir::embedding_bag: left to plain ATen
    assert not EmbeddingBagOverride().matches(model.bag)
    step = capture_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        _loss,
        _batch(),
        overrides=[EmbeddingBagOverride()],
    )
    assert not [n for n in step.graph.nodes if n.target == torch.ops.recir.embedding_bag.default]
    assert step.meta["recir.overrides"] == []


def test_capture_overrides_stand_in_must_keep_parameter_names() -> None:
    class Renaming(Override):
        name: ClassVar[str] = "test-renaming"

        def matches(self, module: nn.Module) -> bool:
            return isinstance(module, nn.EmbeddingBag)

        def replace(self, module: nn.Module, path: str) -> nn.Module:
            standin = nn.Module()
            standin.table = module.weight  # wrong attribute name
            return standin

    model = _Bags("sum_offsets")
    with pytest.raises(CaptureError, match=r"(?s)bag\.weight.*Fix:"):
        capture_train_step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch(), overrides=[Renaming()]
        )
