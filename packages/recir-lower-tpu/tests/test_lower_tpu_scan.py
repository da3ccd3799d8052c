"""``TPUOptions(regions="repeated")``: each run of identical layers traced once as a ``lax.scan``; the
step computes what the whole step computes (losses, parameters, optimizer state, dropout's stream)."""

from __future__ import annotations

import logging

import jax
import pytest
import recir.lower_tpu as lt
import torch
import torch.nn.functional as F
from recir.capture import capture_train_step, testing
from recir.transforms import ConfigError
from torch import nn

# the same ops on the same operands: XLA may fuse the loop body differently from the unrolled layers
RTOL, ATOL = (1e-3, 1e-4) if jax.default_backend() == "tpu" else (1e-5, 1e-6)


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class _Stack(nn.Module):
    """A table, identical blocks (a ModuleList, each with its own dropout draw) and a head."""

    def __init__(self, layers: int, d: int = 16) -> None:
        super().__init__()
        self.table = nn.Embedding(40, d)
        self.blocks = nn.ModuleList(_Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.table(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1)).squeeze(-1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(model(batch["ids"]), batch["y"])


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"ids": torch.randint(0, 40, (8, 6), generator=g), "y": torch.randn(8, generator=g)}


def _train(layers: int, regions: str, steps: int = 3) -> tuple[lt.TPUCompiledStep, list[torch.Tensor], dict]:
    torch.manual_seed(0)
    model = _Stack(layers)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = capture_train_step(model, optimizer, _loss, _batch(0))
    compiled = lt.compile(step, options=lt.TPUOptions(regions=regions, persistent_cache=False))
    state = compiled.init_state(model, optimizer)
    losses = []
    for i in range(steps):
        state, outputs = compiled(state, _batch(i))
        losses.append(outputs[0] if isinstance(outputs, (list, tuple)) else outputs)
    return compiled, losses, compiled.state_dict(state)


def test_repeated_layers_scan_once_and_match_the_whole_step(caplog):
    caplog.set_level(logging.INFO, logger="recir.lower_tpu")
    whole, whole_losses, whole_state = _train(4, "whole")
    scanned, losses, state = _train(4, "repeated")
    assert whole.scans is None
    plan = scanned.scans
    assert plan is not None and len(plan.runs) == 2, plan and plan.describe()  # forward, backward
    forward, backward = plan.runs
    assert len(forward.pieces) == 4 and len(backward.pieces) >= 2  # the outer blocks' backward may differ
    assert forward.carry and forward.xs and backward.xs  # the hidden state; the weights; saved activations
    assert "regions='repeated': 2 scan(s)" in caplog.text
    assert scanned.lower().as_text().count("stablehlo.while") == 2
    assert "stablehlo.while" not in whole.lower().as_text()
    for a, b in zip(losses, whole_losses):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    # parameters and Adam's moments; dropout draws each layer's own counters inside the loop
    assert not testing.state_mismatches(state, whole_state, rtol=RTOL, atol=ATOL)
    assert any(k.startswith("optim:") or "exp_avg" in k for k in state), sorted(state)[:5]


def test_a_step_without_repeated_layers_compiles_whole(caplog):
    caplog.set_level(logging.INFO, logger="recir.lower_tpu")
    compiled, _, _ = _train(1, "repeated", steps=1)
    assert compiled.scans is None
    assert "regions='repeated' compiles the step whole" in caplog.text


def test_bad_regions_option_names_the_choices():
    with pytest.raises(ConfigError, match="regions='layers'.*whole, repeated"):
        lt.TPUOptions(regions="layers")
