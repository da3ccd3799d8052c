"""recir::check_jagged on the TPU path: the id/length check runs on the host (io_callback) every step
and a bad batch raises recir's DataError naming the table, feature and id.

``compile`` runs recir-embedding's ``prepare_for_lowering``, which drops check nodes for the TPU target;
compile runs them on the host before each step instead (``TPUOptions.host_checks``, on by default). A
graph that keeps them (built with ``TPUCompiledStep`` directly) gets the io_callback lowering.
"""

from __future__ import annotations

import pytest
import recir.embedding  # noqa: F401 - defines recir::check_jagged
import torch
from recir.lower_tpu import TPUCompiledStep, TPUOptions, compile
from recir.lower_tpu._placement import Placement
from recir.transforms import DataError
from torch import nn

pytestmark = pytest.mark.tpu


class CheckedLookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))

    def forward(self, values, lengths):
        ids = torch.ops.recir.check_jagged(values, lengths, 2, [4], [10], "f", "t")
        return self.table.index_select(0, ids).sum()


def _loss(model, b):
    return (model(b["values"], b["lengths"]) - 1.0) ** 2


def test_check_jagged_passes_good_batches_and_rejects_bad_ids(sgd_step):
    torch.manual_seed(0)
    model = CheckedLookup()
    good = {"values": torch.tensor([1, 2, 9, 0]), "lengths": torch.tensor([2, 1])}
    step = sgd_step(model, _loss, good)
    compiled = TPUCompiledStep(step, Placement(), TPUOptions(), None)
    state = compiled.init_state(model)
    state, (loss,) = compiled(state, good)
    expected = (model.table.detach().index_select(0, good["values"]).sum() - 1.0) ** 2
    torch.testing.assert_close(loss, expected)

    bad = {"values": torch.tensor([1, 12, 9, 0]), "lengths": torch.tensor([2, 1])}
    with pytest.raises(DataError, match=r"table 't' \(feature 'f'\): id 12 .* outside \[0, 10\)"):
        compiled(state, bad)


def test_compile_leaves_batch_checks_to_the_host_on_tpu(sgd_step):
    model = CheckedLookup()
    good = {"values": torch.tensor([1, 2, 9, 0]), "lengths": torch.tensor([2, 1])}
    compiled = compile(sgd_step(model, _loss, good))
    targets = {n.target for n in compiled.step.graph.nodes}
    assert torch.ops.recir.check_jagged.default not in targets
    assert compiled.step.meta["recir.embedding"]["checks_removed"] == 1


@pytest.mark.parametrize(
    ("values", "lengths", "match"),
    [
        ([1, 12, 9, 0], [2, 1], r"table 't' \(feature 'f'\): id 12 .* outside \[0, 10\)"),
        ([1, -1, 9, 0], [2, 1], r"id -1"),
        ([1, 2, 9, 0], [-1, 1], r"length"),
        ([1, 2, 9, 0], [5, 1], r"length"),
    ],
)
def test_compile_checks_ids_and_lengths_on_the_host_before_the_step(sgd_step, values, lengths, match):
    torch.manual_seed(0)
    model = CheckedLookup()
    good = {"values": torch.tensor([1, 2, 9, 0]), "lengths": torch.tensor([2, 1])}
    compiled = compile(sgd_step(model, _loss, good))
    assert len(compiled.host_checks) == 1
    state = compiled.init_state(model)
    state, _ = compiled(state, good)
    before = compiled.state_dict(state)
    bad = {"values": torch.tensor(values), "lengths": torch.tensor(lengths)}
    with pytest.raises(DataError, match=match):
        compiled(state, bad)
    after = compiled.state_dict(state)  # raised before the device ran: the state is untouched
    assert all(torch.equal(before[k], after[k]) for k in before)
    # host_checks=False: a trusted pipeline skips them (the out-of-range id is then clamped by XLA)
    unchecked = compile(sgd_step(model, _loss, good), options=TPUOptions(host_checks=False))
    assert unchecked.host_checks == []
    unchecked(unchecked.init_state(model), bad)


class PlainTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 3)
        self.bag = nn.EmbeddingBag(7, 3, mode="sum")

    def forward(self, ids, bag_ids, offsets):
        return self.emb(ids).sum() + self.bag(bag_ids, offsets).sum()


def _plain_loss(model, b):
    return (model(b["ids"], b["bag_ids"], b["offsets"]) - 1.0) ** 2


@pytest.mark.parametrize(
    ("ids", "bag_ids", "match"),
    [
        (
            [1, 10, 2],
            [0, 1, 2, 3],
            r"table 'emb.weight': id 10 at position 1 of batch leaf 'b0' is outside \[0, 10\)",
        ),
        ([1, 2, 3], [0, -3, 2, 3], r"table 'bag.weight': id -3 at position 1 .* outside \[0, 7\)"),
    ],
)
def test_plain_embedding_ids_are_checked_on_the_host(sgd_step, ids, bag_ids, match):
    # plain nn.Embedding / nn.EmbeddingBag: XLA would clamp a bad id; the host check raises first
    model = PlainTables()
    good = {
        "ids": torch.tensor([1, 2, 9]),
        "bag_ids": torch.tensor([0, 1, 2, 6]),
        "offsets": torch.tensor([0, 2]),
    }
    compiled = compile(sgd_step(model, _plain_loss, good))
    assert len(compiled.host_checks) == 2
    state = compiled.init_state(model)
    state, _ = compiled(state, good)
    with pytest.raises(DataError, match=match):
        compiled(state, dict(good, ids=torch.tensor(ids), bag_ids=torch.tensor(bag_ids)))
