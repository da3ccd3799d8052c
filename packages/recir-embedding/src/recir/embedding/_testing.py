"""A minimal make_fx step builder for tests and benchmarks until ``recir.capture`` lands.

It emits the metadata recir.capture guarantees (``recir.optimizer``, ``recir.grad_of``,
``recir.optim_param``, ``recir.phase``, ``val``) for SGD, Adagrad, RowWiseAdagrad and Adam(W).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from recir.transforms import (
    GRAD_OF_KEY,
    OPTIM_PARAM_KEY,
    OPTIMIZER_KEY,
    OVERRIDE_KEY,
    PHASE_KEY,
    STEP_SLOT,
    BatchSlot,
    OutputSlot,
    Signature,
    StateSlot,
    StepGraph,
    apply_update,
    lr_slot,
    optim_slot,
    override_for_op,
    param_optim,
    param_slot,
)
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.nn.utils.stateless import _reparametrize_module

LR_SLOT = lr_slot(0)  # one param group
DEFAULTS: dict[str, dict[str, Any]] = {
    "sgd": {"lr": 0.1},
    "adagrad": {"lr": 0.1, "eps": 1e-10},
    "rowwise_adagrad": {"lr": 0.1, "eps": 1e-8},
    "adam": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01},
}


def dense_update(
    kind: str, hp: dict[str, Any], p: Tensor, g: Tensor, st: list[Tensor], lr: Tensor, step: Tensor
):
    """The dense update of a whole table (recir.transforms.apply_update: torch.optim's maths, FBGEMM's
    for RowWiseAdagrad). Returns (p, states)."""
    spec = param_optim(kind, hp)
    keys = spec.state_keys
    new_p, new = apply_update(spec, p, g, dict(zip(keys, st)), lr, step)
    return new_p, [new[k] for k in keys]


def _node(t: Tensor) -> torch.fx.Node:
    return get_proxy_slot(t, get_proxy_mode().tracer).proxy.node


def _count() -> int:
    return len(get_proxy_mode().tracer.graph.nodes)


def build_step(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batch: Any,
    kind: str = "sgd",
    hparams: dict[str, Any] | None = None,
) -> StepGraph:
    """Trace ``loss_fn(model, batch)``, its gradients and a ``kind`` optimizer update into a StepGraph."""
    hp = {**DEFAULTS[kind], **(hparams or {})}
    params = dict(model.named_parameters())
    slots = [StateSlot(param_slot(n), "param", tuple(p.shape), p.dtype) for n, p in params.items()]
    optim_meta: dict[str, Any] = {}
    for n, p in params.items():
        state = {}
        for key in param_optim(kind, hp).state_keys:
            shape = (p.shape[0],) if kind == "rowwise_adagrad" else tuple(p.shape)
            slots.append(StateSlot(optim_slot(n, key), "optim", shape, p.dtype))
            state[key] = optim_slot(n, key)
        optim_meta[param_slot(n)] = {
            "kind": kind,
            "group": 0,
            "hparams": dict(hp),
            "state": state,
            "lr_slot": LR_SLOT,
            "step_slot": STEP_SLOT if kind.startswith("adam") else None,
        }
    slots.append(StateSlot(LR_SLOT, "optim", (), torch.float32))
    slots.append(StateSlot(STEP_SLOT, "optim", (), torch.float32))
    leaves, spec = pytree.tree_flatten(batch)
    names = [s.name for s in slots]
    n_state = len(slots)
    marks: dict[str, Any] = {}

    def fn(*flat: Tensor):
        st = dict(zip(names, flat[:n_state]))
        b = pytree.tree_unflatten(list(flat[n_state:]), spec)
        marks["forward"] = _count()
        with torch.enable_grad():
            live = {n: st[param_slot(n)].detach().requires_grad_() for n in params}
            with _reparametrize_module(model, live):
                loss = loss_fn(model, b)
            marks["backward"] = _count()
            grads = torch.autograd.grad(loss, list(live.values()), allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, live.values())]
        for n, g in zip(params, grads):
            _node(g).meta[GRAD_OF_KEY] = param_slot(n)
        marks["optimizer"] = _count()
        new = dict(st)
        lr, step = st[LR_SLOT], st[STEP_SLOT] + 1
        new[STEP_SLOT] = step
        ranges = {}
        for n, g in zip(params, grads):
            start = _count()
            skeys = [optim_slot(n, k) for k in param_optim(kind, hp).state_keys]
            p_new, s_new = dense_update(kind, hp, st[param_slot(n)], g, [st[k] for k in skeys], lr, step)
            new[param_slot(n)] = p_new
            new.update(zip(skeys, s_new))
            ranges[param_slot(n)] = (start, _count())
        marks["ranges"] = ranges
        out = [new[k] if new[k] is not st[k] else new[k].clone() for k in names]
        return (*out, loss.detach())

    example = [p.detach() for p in params.values()] + [
        torch.zeros(s.shape, dtype=s.dtype) for s in slots[len(params) :]
    ]
    gm = make_fx(fn, tracing_mode="fake")(*example, *leaves)
    nodes = list(gm.graph.nodes)
    phase_of = [
        ("forward", marks["forward"]),
        ("backward", marks["backward"]),
        ("optimizer", marks["optimizer"]),
    ]
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "output"):
            continue
        node.meta[PHASE_KEY] = [ph for ph, start in phase_of if i >= start][-1]
        if override_for_op(node.target) is not None:
            node.meta[OVERRIDE_KEY] = override_for_op(node.target)
        for slot, (a, z) in marks["ranges"].items():
            if a <= i < z:
                node.meta[OPTIM_PARAM_KEY] = slot
    gm.graph.eliminate_dead_code()
    gm.recompile()
    sig = Signature(
        state=tuple(slots),
        batch=tuple(BatchSlot(f"batch:{i}", tuple(x.shape), x.dtype) for i, x in enumerate(leaves)),
        outputs=(OutputSlot("loss", (), torch.float32),),
        batch_spec=spec,
    )

    def init(slot: StateSlot, model: nn.Module, optimizer: Any) -> Tensor | None:
        if slot.name == LR_SLOT:
            return torch.tensor(float(hp["lr"]))
        if slot.kind == "optim":
            return torch.zeros(slot.shape, dtype=slot.dtype)
        return None

    return StepGraph(gm, sig, initializers=(init,), meta={OPTIMIZER_KEY: optim_meta})
