"""`parity` compares every parameter, buffer and optimizer-state slot of both sides: a slot one side
lacks, another shape or a NaN/Inf fails it, and it prints how many slots and elements it compared."""

from __future__ import annotations

import re

import torch
from recir.dlrmv3 import EagerTrainer, TrainOptions, run_parity
from recir.dlrmv3._train import build

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1, input_dropout=0.0, layer_dropout=0.0, optimizer="adagrad")  # fmt: skip


def test_dlrmv3_parity_compares_every_slot_of_both_sides():
    lines: list[str] = []
    rows, ok = run_parity(TrainOptions(target="eager-graph", **TINY), 2, log=lines.append)  # type: ignore[arg-type]
    assert ok and not any(r.problems for r in rows), lines
    # Adagrad: every parameter, every buffer, one `sum` per parameter, the shared step, two group lrs
    model, _, _ = build(TrainOptions(**TINY))  # type: ignore[arg-type]
    params, buffers = list(model.parameters()), list(model.buffers())
    slots = 2 * len(params) + len(buffers) + 1 + 2
    elements = 2 * sum(p.numel() for p in params) + sum(b.numel() for b in buffers) + 1 + 2
    summary = next(line for line in lines if line.startswith("compared "))
    assert re.match(rf"compared {slots} slots and {elements} elements per step .*0 problem\(s\)", summary), (
        summary,
        slots,
        elements,
    )


def _tampered(monkeypatch, tamper) -> list[str]:  # type: ignore[no-untyped-def]
    """run_parity (1 step) whose "compiled" side is an eager trainer whose state `tamper` edits."""

    class Tampered(EagerTrainer):
        def state_dict(self) -> dict[str, torch.Tensor]:
            state = {k: v.clone() for k, v in super().state_dict().items()}
            tamper(state)
            return state

    monkeypatch.setattr("recir.dlrmv3._parity.make_trainer", lambda _t, m, o, *_a, **_k: Tampered(m, o))
    lines: list[str] = []
    _, ok = run_parity(TrainOptions(target="eager", **TINY), 1, log=lines.append)  # type: ignore[arg-type]
    assert not ok and lines[-1] == "parity FAILED (atol 0.0001)", lines
    return [line.strip() for line in lines if line.strip().startswith("problem:")]


def test_dlrmv3_parity_fails_on_a_slot_it_cannot_compare(monkeypatch):
    bias, table_sum = "param:head.2.bias", "optim:ec.embeddings.post_id.weight:sum"
    assert _tampered(monkeypatch, lambda s: s.pop(bias)) == [f"problem: {bias}: missing on the compiled side"]
    assert _tampered(monkeypatch, lambda s: s.update({"optim:extra": torch.ones(1)})) == [
        "problem: optim:extra: missing on the eager side"
    ]
    assert _tampered(monkeypatch, lambda s: s.update({bias: torch.zeros(2)})) == [
        f"problem: {bias}: shape [1] eager, [2] compiled"
    ]

    def nan(state: dict[str, torch.Tensor]) -> None:
        state[table_sum].view(-1)[3] = float("nan")
        state[bias][0] = float("inf")

    assert _tampered(monkeypatch, nan) == [
        f"problem: {table_sum}: 1 NaN/Inf value(s) on the compiled side",
        f"problem: {bias}: 1 NaN/Inf value(s) on the compiled side",
    ]
