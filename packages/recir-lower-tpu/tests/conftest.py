"""Fixtures for recir-lower-tpu tests: a tiny hand-made StepGraph builder (make_fx of a pure SGD step).

It exists so this package's tests do not depend on recir-capture; capture-based tests use the real thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from recir.transforms import PHASE_KEY, BatchSlot, OutputSlot, Signature, StateSlot, StepGraph
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx


def build_sgd_step(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any, lr: float = 0.1
) -> StepGraph:
    """``(params..., batch...) -> (params - lr * grad..., loss)`` traced to ATen with make_fx."""
    names = [n for n, _ in model.named_parameters()]
    leaves, spec = pytree.tree_flatten(batch)

    def pure_step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = dict(zip(names, flat[: len(names)]))
        user_batch = pytree.tree_unflatten(list(flat[len(names) :]), spec)

        def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return loss_fn(_Reparam(model, p), user_batch)

        grads, loss = torch.func.grad_and_value(loss_of)(params)
        return (*(params[n] - lr * grads[n] for n in names), loss.detach())

    state = [p.detach() for p in model.parameters()]
    gm = make_fx(pure_step, tracing_mode="fake")(*state, *leaves)
    sig = Signature(
        state=tuple(StateSlot(f"param:{n}", "param", tuple(p.shape), p.dtype) for n, p in zip(names, state)),
        batch=tuple(BatchSlot(f"b{i}", tuple(t.shape), t.dtype) for i, t in enumerate(leaves)),
        outputs=(OutputSlot("loss", (), torch.float32),),
        batch_spec=spec,
    )
    _tag_phases(gm)
    return StepGraph(gm, sig)


class _Reparam:
    """Calls ``model`` with parameters swapped for ``params`` (torch.func.functional_call)."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor]):
        self.model, self.params = model, params

    def __call__(self, *args: Any) -> Any:
        return torch.func.functional_call(self.model, self.params, args)


def _tag_phases(gm: torch.fx.GraphModule) -> None:
    """forward up to the loss, optimizer for the final updates, backward in between (good enough here)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss = outputs[-1]
    update_nodes = set()
    for out in outputs[:-1]:
        update_nodes.add(out)
        update_nodes.update(a for a in out.args if isinstance(a, torch.fx.Node) and a.op == "call_function")
    phase = "forward"
    for n in nodes:
        if n in update_nodes:
            n.meta[PHASE_KEY] = "optimizer"
            continue
        n.meta[PHASE_KEY] = phase
        if n is loss or loss in n.args:
            phase = "backward"


@pytest.fixture
def sgd_step() -> Callable[..., StepGraph]:
    return build_sgd_step
