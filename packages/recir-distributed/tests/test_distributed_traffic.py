"""``table_traffic``: the bytes one device sends per step under each table placement, from the lookups'
shapes, and ``plan`` listing them for every table with the chosen placement marked."""

from __future__ import annotations

import pytest
import recir.distributed as rd
import torch
from recir.capture import capture_train_step
from recir.embedding import EmbeddingBagOverride
from torch import nn


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.EmbeddingBag(64, 16, mode="sum")
        self.fc = nn.Linear(16, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fc(self.a(b["ids"], b["off"][:-1])).squeeze(-1)


def _step():
    model = _Bag()
    batch = {"ids": torch.randint(0, 64, (32,)), "off": torch.arange(0, 33, 4), "y": torch.randn(8)}
    return capture_train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        lambda m, b: ((m(b) - b["y"]) ** 2).mean(),
        batch,
        overrides=[EmbeddingBagOverride()],
    )


def test_traffic_of_each_placement_from_the_lookup_shapes():
    step = _step()
    (t,) = rd.table_traffic(step, rd.Mesh(axes={"data": 8}), batch="global").values()
    # 32 int64 ids and 8 bags over 8 devices: 4 ids and 1 bag each; rows of 16 float32 = 64 bytes
    assert (t.table, t.ids, t.rows_out, t.dim, t.row_bytes, t.id_bytes, t.shards) == (
        "param:a.weight",
        4,
        1,
        16,
        64,
        8,
        8,
    )
    assert t.bytes_sent("table_wise") == 7 * 64  # the owner sends a row to each of 7 devices
    assert t.bytes_sent("row_wise") == 7 * (4 * 8 + 2 * 64)
    assert t.bytes_sent("column_wise") == 7 * (4 * 8 + 2 * 64 // 8)
    assert t.bytes_sent("ring_shift") == 8 * 4 * (8 + 64) + 7 * 64
    local = rd.table_traffic(step, rd.Mesh(axes={"data": 8}), batch="local")["param:a.weight"]
    assert (local.ids, local.rows_out) == (32, 8)  # a local batch is already one device's
    one = rd.table_traffic(step, rd.Mesh(axes={"data": 1}))["param:a.weight"]
    assert one.bytes_sent("row_wise") == 0
    with pytest.raises(ValueError, match="unknown table placement 'diagonal'"):
        t.bytes_sent("diagonal")


def test_plan_lists_the_traffic_of_every_choice_and_marks_its_own():
    step = _step()
    for mode, chosen in (
        (rd.row_wise(), "row_wise"),
        (rd.table_wise(), "table_wise"),
        ("auto", "table_wise"),
    ):
        plan = rd.plan(step, mode, rd.Mesh(axes={"data": 8}), batch="global")
        (line,) = [e for e in plan.explanation if "communication per step" in e]
        assert line == (
            "param:a.weight: communication per step per device: "
            + ", ".join(
                f"{s} {b}{'*' if s == chosen else ''}"
                for s, b in (
                    ("table_wise", "448 B"),
                    ("row_wise", "1.1 KiB"),
                    ("column_wise", "336 B"),
                    ("ring_shift", "2.7 KiB"),
                )
            )
        ), line
        assert line in str(plan)
    assert not [
        e for e in rd.plan(step, rd.row_wise(), rd.Mesh(axes={"data": 1})).explanation if "communication" in e
    ]
