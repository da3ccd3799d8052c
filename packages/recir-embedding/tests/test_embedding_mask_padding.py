"""recir-embed-mask-padding: a padded jagged id feature trains exactly like the same ids unpadded.

The model reduces over the jagged dimension without looking at the lengths (a sum over every looked-up
row), so without the rewrite the padding (repeats of a real id) reaches the loss and the table's gradient.
"""

from __future__ import annotations

import pytest
import torch
from recir.capture import capture_train_step
from recir.embedding import JAGGED_KEY, MaskPadding
from recir.transforms import ConfigError, Pipeline, verify
from torch import nn

ROWS, D, B, REAL, PADDED = 40, 4, 4, 11, 16


class SeqModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(ROWS, D, generator=torch.Generator().manual_seed(0)))
        self.head = nn.Linear(D + 1, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        rows = torch.ops.recir.embedding(self.table, torch.remainder(b["seq_ids"] * 7 + 3, ROWS))
        pooled = rows.sum(0, keepdim=True).expand(B, D)  # every row of the batch, padding included
        return self.head(torch.cat([pooled, b["dense"]], 1)).squeeze(-1)


def _loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(b) - b["y"]).pow(2).mean()


def _batch(k: int, padded: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(0, 1000, (REAL,), generator=g)
    if padded:  # pad_to_bucket's layout: real ids first, then a real id repeated
        ids = torch.cat([ids, ids[:1].expand(PADDED - REAL)])
    cuts = torch.sort(torch.randint(0, REAL + 1, (B - 1,), generator=g)).values
    lengths = torch.diff(torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.full((1,), REAL)]))
    return {
        "seq_ids": ids,
        "seq_lengths": lengths,
        "dense": torch.randn(B, 1, generator=g),
        "y": torch.randn(B, generator=g),
    }


def _trained(padded: bool, mask: bool, compile=None, steps: int = 3):  # noqa: ANN001, ANN202
    torch.manual_seed(0)
    model = SeqModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, _loss, _batch(0, padded))
    if mask:
        pipe = Pipeline([MaskPadding()])
        step = pipe.run(step)
        assert pipe.records[0].stats["masked"] == 1
    run = compile(step) if compile is not None else step
    state, losses = run.init_state(model, opt), []
    for k in range(steps):
        state, out = run(state, _batch(k, padded))
        losses.append(float(out[0]))
    return step, {k: torch.as_tensor(v) for k, v in run.state_dict(state).items()}, losses


def _same(a: dict, b: dict, atol: float, rtol: float = 0.0) -> None:
    for name, want in b.items():
        assert torch.allclose(a[name], want, atol=atol, rtol=rtol), (
            name,
            (a[name] - want).abs().max().item(),
        )


def test_padded_ids_with_the_rewrite_train_like_the_unpadded_ids():
    _, want, want_losses = _trained(padded=False, mask=False)
    step, got, losses = _trained(padded=True, mask=True)
    verify(step)
    _same(got, want, 1e-6)
    assert losses == pytest.approx(want_losses, abs=1e-6)
    # without it the padding (a repeated real id) is summed into the loss and trains that row again
    _, leaky, leaky_losses = _trained(padded=True, mask=False)
    assert abs(leaky_losses[0] - want_losses[0]) > 1e-3
    assert (leaky["param:table"] - want["param:table"]).abs().max() > 1e-3


def test_the_jagged_dimension_is_marked_from_the_batch_spec():
    step, _, _ = _trained(padded=True, mask=True, steps=0)
    ids = next(n for n in step.graph.nodes if n.op == "placeholder" and n.name.endswith("seq_ids"))
    assert ids.meta[JAGGED_KEY] == {"dim": 0, "ids": "seq_ids", "lengths": "seq_lengths"}
    (lookup,) = [n for n in step.graph.nodes if n.target is torch.ops.recir.embedding.default]
    assert lookup.meta[JAGGED_KEY]["lengths"] == "seq_lengths"
    (masked,) = lookup.users  # the rows reach the model only through the mask
    assert masked.target is torch.ops.aten.mul.Tensor
    (grad,) = [n for n in step.graph.nodes if n.target is torch.ops.aten.index_add.default]
    assert grad.args[3].target is torch.ops.aten.mul.Tensor  # the table's per-id gradient is masked too


@pytest.mark.parametrize("lowering", ["recir.lower_gpu", "recir.lower_tpu"])
def test_both_lowerings_train_the_masked_step_like_the_unpadded_one(lowering):
    lower = pytest.importorskip(lowering).compile  # sibling packages, absent from a standalone run
    _, want, want_losses = _trained(padded=False, mask=False)
    _, got, losses = _trained(padded=True, mask=True, compile=lower)
    _same(got, want, 1e-5, 1e-5)  # compiled: float32 reassociation (a wrong mask is off by > 1e-3)
    assert losses == pytest.approx(want_losses, abs=1e-5, rel=1e-5)


def test_a_lengths_slot_that_does_not_exist_is_named():
    torch.manual_seed(0)
    model = SeqModel()
    step = capture_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, _batch(0, True))
    with pytest.raises(ConfigError, match="no batch slot 'lens'"):
        MaskPadding(lengths={"seq_ids": "lens"})(step)
    result = MaskPadding(lengths={"seq_ids": "seq_lengths"})(step)
    assert result.changed and result.stats["masked"] == 1
