"""Hand-built StepGraphs for recir-transforms' tests: make_fx of small pure step functions, phases tagged here.

A step function takes ``(state, batch)`` lists and returns ``(new_state, outputs)``; it calls
``mark_phase("backward")`` / ``mark_phase("optimizer")`` where those phases begin (nodes are tagged by position).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from recir.transforms import BatchSlot, OutputSlot, Signature, StateSlot, StepGraph
from recir.transforms.testing import mark_phase as mark_phase
from recir.transforms.testing import trace_with_phases


def _sanitize(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def trace_step(
    fn: Callable[[list[torch.Tensor], list[torch.Tensor]], tuple[list[torch.Tensor], list[torch.Tensor]]],
    state: dict[str, tuple[str, torch.Tensor]],
    batch: dict[str, tuple[str, torch.Tensor]],
    output_names: Sequence[str],
    *,
    dynamic: bool = False,
) -> tuple[StepGraph, list[torch.Tensor], list[torch.Tensor]]:
    """Trace ``fn`` with make_fx (fake mode) into a StepGraph; returns it with the example state and batch.

    ``state`` maps slot name -> (kind, example tensor); ``batch`` maps slot name -> (role, example tensor).
    """
    state_vals = [t for _, t in state.values()]
    batch_vals = [t for _, t in batch.values()]
    n_state = len(state_vals)

    def flat(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        new_state, outputs = fn(list(args[:n_state]), list(args[n_state:]))
        return (*new_state, *outputs)

    gm = trace_with_phases(flat, *state_vals, *batch_vals, tracing_mode="symbolic" if dynamic else "fake")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, [*state, *batch]):
        node._rename(_sanitize(name))
    gm.recompile()
    out_vals = [n.meta["val"] for n in next(n for n in gm.graph.nodes if n.op == "output").args[0][n_state:]]
    signature = Signature(
        state=tuple(
            StateSlot(name, kind, tuple(t.shape), t.dtype)  # type: ignore[arg-type]
            for name, (kind, t) in state.items()
        ),
        batch=tuple(
            BatchSlot(name, tuple(t.shape), t.dtype, role)  # type: ignore[arg-type]
            for name, (role, t) in batch.items()
        ),
        outputs=tuple(OutputSlot(n, tuple(v.shape), v.dtype) for n, v in zip(output_names, out_vals)),
    )
    return StepGraph(gm, signature, dynamic=dynamic), state_vals, batch_vals


def _mlp_sgd(state: list[torch.Tensor], batch: list[torch.Tensor], lr: float = 0.1, momentum: float = 0.9):
    w1, b1, w2, scale, m1, mb1, m2 = state
    x, y = batch
    w1, b1, w2 = (p.detach().requires_grad_(True) for p in (w1, b1, w2))
    h = torch.relu(x @ w1 + b1)
    pred = (h @ w2) * scale
    loss = ((pred - y) ** 2).mean()
    outputs = [loss.detach(), pred.detach().sum()]
    mark_phase("backward")
    g1, gb1, g2 = torch.autograd.grad(loss, [w1, b1, w2])
    mark_phase("optimizer")
    new_m = [momentum * m + g for m, g in zip((m1, mb1, m2), (g1, gb1, g2))]
    new_p = [p - lr * m for p, m in zip((w1, b1, w2), new_m)]
    return [*(t.detach() for t in new_p), scale, *(t.detach() for t in new_m)], outputs


def mlp_sgd_step(
    din: int = 4, hidden: int = 8, dout: int = 2, batch: int = 3, seed: int = 0
) -> tuple[StepGraph, list[torch.Tensor], list[torch.Tensor]]:
    """One SGD-with-momentum step of a 2-layer MLP; ``buffer:scale`` is a frozen slot returned unchanged.

    State: param:fc1.weight, param:fc1.bias, param:fc2.weight, buffer:scale, and the three momentum slots.
    Outputs: loss, pred_sum.
    """
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(din, hidden, generator=g)
    b1 = torch.randn(hidden, generator=g)
    w2 = torch.randn(hidden, dout, generator=g)
    state = {
        "param:fc1.weight": ("param", w1),
        "param:fc1.bias": ("param", b1),
        "param:fc2.weight": ("param", w2),
        "buffer:scale": ("buffer", torch.tensor(1.5)),
        "optim:fc1.weight:momentum_buffer": ("optim", torch.zeros_like(w1)),
        "optim:fc1.bias:momentum_buffer": ("optim", torch.zeros_like(b1)),
        "optim:fc2.weight:momentum_buffer": ("optim", torch.zeros_like(w2)),
    }
    data = {
        "dense": ("dense", torch.randn(batch, din, generator=g)),
        "label": ("label", torch.randn(batch, dout, generator=g)),
    }
    return trace_step(_mlp_sgd, state, data, ["loss", "pred_sum"])


def run_steps(step: StepGraph, state: list[torch.Tensor], batch: list[torch.Tensor], n: int = 2):
    """Run ``n`` steps on the reference interpreter; returns the final state and the last outputs."""
    outputs = None
    for _ in range(n):
        state, outputs = step(state, batch)
    return state, outputs


def _embedding_sgd(state: list[torch.Tensor], batch: list[torch.Tensor], lr: float = 0.5):
    table, w = state
    ids, offsets, y = batch
    table, w = (p.detach().requires_grad_(True) for p in (table, w))
    pooled = torch.ops.recir.embedding_bag(table, ids, offsets, None, 0)
    loss = ((pooled @ w - y) ** 2).mean()
    outputs = [loss.detach()]
    mark_phase("backward")
    g_table, g_w = torch.autograd.grad(loss, [table, w])
    mark_phase("optimizer")
    return [(table - lr * g_table).detach(), (w - lr * g_w).detach()], outputs


def embedding_sgd_step(rows: int = 10, dim: int = 4, bags: int = 3, seed: int = 0):
    """SGD on a pooled ``recir::embedding_bag`` lookup followed by a linear layer (override meta tagged)."""
    from recir.transforms import OVERRIDE_KEY, override_for_op

    g = torch.Generator().manual_seed(seed)
    state = {
        "param:emb.weight": ("param", torch.randn(rows, dim, generator=g)),
        "param:head.weight": ("param", torch.randn(dim, 1, generator=g)),
    }
    data = {
        "ids": ("ids", torch.tensor([1, 3, 3, 7, 0, 9])),
        "offsets": ("offsets", torch.tensor([0, 2, 3, 6])),
        "label": ("label", torch.randn(bags, 1, generator=g)),
    }
    step, s, b = trace_step(_embedding_sgd, state, data, ["loss"])
    for node in step.graph.nodes:
        owner = override_for_op(node.target) if node.op == "call_function" else None
        if owner is not None:
            node.meta[OVERRIDE_KEY] = owner
    return step, s, b
