"""Fixtures for recir-lower-tpu tests: a tiny hand-made StepGraph builder (make_fx of a pure SGD step).

It exists so this package's tests do not depend on recir-capture; capture-based tests use the real thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from recir.transforms import (
    OVERRIDE_KEY,
    PHASE_KEY,
    BatchSlot,
    OutputSlot,
    Signature,
    StateSlot,
    StepGraph,
    override_for_op,
)
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx


def build_sgd_step(
    model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batch: Any, lr: float = 0.1
) -> StepGraph:
    """``(params..., batch...) -> (params - lr * grad..., loss)`` traced to ATen with make_fx."""
    names = [n for n, _ in model.named_parameters()]
    leaves, spec = pytree.tree_flatten(batch)

    def pure_step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        params = [t.detach().requires_grad_(True) for t in flat[: len(names)]]
        user_batch = pytree.tree_unflatten(list(flat[len(names) :]), spec)
        # torch.autograd.grad (not torch.func): custom ops' autograd formulas must trace too.
        with torch.enable_grad():
            loss = loss_fn(_Reparam(model, dict(zip(names, params))), user_batch)
            grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            return (*(p - lr * g for p, g in zip(params, grads)), loss.detach())

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
    """forward: what the loss depends on; optimizer: the final updates; backward: everything else."""
    gm.graph.eliminate_dead_code()  # drops getitems of unused (None) backward results
    gm.recompile()
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    loss = outputs[-1].args[0] if outputs[-1].target == torch.ops.aten.detach.default else outputs[-1]
    forward: set[torch.fx.Node] = set()
    todo = [loss]
    while todo:
        n = todo.pop()
        if n not in forward:
            forward.add(n)
            todo.extend(n.all_input_nodes)
    update = {o for o in outputs[:-1]} | {
        a for o in outputs[:-1] for a in o.all_input_nodes if a.target == torch.ops.aten.mul.Tensor
    }
    rank = {"forward": 0, "backward": 1, "optimizer": 2}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        own = "optimizer" if n in update else "forward" if n in forward else "backward"
        inputs = [m.meta[PHASE_KEY] for m in n.all_input_nodes if PHASE_KEY in m.meta]
        n.meta[PHASE_KEY] = max([own, *inputs], key=rank.__getitem__)
        if override_for_op(n.target) is not None:
            n.meta[OVERRIDE_KEY] = override_for_op(n.target)


@pytest.fixture
def sgd_step() -> Callable[..., StepGraph]:
    return build_sgd_step
