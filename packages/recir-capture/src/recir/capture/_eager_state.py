"""An eager model and its torch.optim optimizers as a StepGraph's flat state, and back.

recir-capture owns the slot names (``param:<path>``, ``buffer:<path>``, ``optim:<path>:<key>``, the shared
``optim:step``), so the conversions between a live model and a state dict live here too: a checkpoint
written by an eager loop loads into a captured step and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from recir.transforms import STEP_SLOT, buffer_slot, optim_slot, param_slot, parse_slot_name
from torch import nn

_T = TypeVar("_T")


def state_from(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, torch.Tensor]:
    """``{slot: tensor}`` of ``model``'s parameters and buffers and every populated optimizer-state entry
    (``optim:<param>:<key>``; eager optimizers count steps per parameter). The tensors are the live ones."""
    state: dict[str, torch.Tensor] = {param_slot(n): p.detach() for n, p in model.named_parameters()}
    state.update({buffer_slot(n): b for n, b in model.named_buffers()})
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in optimizers:
        for p, entries in opt.state.items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    state[optim_slot(names[id(p)], key)] = value
    return state


def load_into(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], state: Mapping[str, Any]
) -> None:
    """Copy ``state``'s slots into ``model`` (parameters, buffers) and ``optimizers`` (their state): the
    inverse of :func:`state_from`, also for a captured step's state, whose one ``optim:step`` becomes every
    Adam/AdamW parameter's step count. Slots the model or optimizers do not have are ignored."""
    with torch.no_grad():
        for slot_of, named in ((param_slot, model.named_parameters()), (buffer_slot, model.named_buffers())):
            for name, t in named:
                if slot_of(name) in state:
                    t.copy_(torch.as_tensor(state[slot_of(name)]).to(t.dtype))
    params = dict(model.named_parameters())
    for opt in optimizers:
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        for name, value in state.items():
            if name == STEP_SLOT:  # a captured step's one Adam step count: every Adam param's `step`
                if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                    for g in opt.param_groups:
                        for p in g["params"]:
                            opt.state[p]["step"] = torch.as_tensor(value).detach().clone().reshape(())
                continue
            slot = parse_slot_name(name) if name.startswith("optim:") else None
            if slot is None or slot.path is None or slot.key is None:
                continue
            p = params.get(slot.path)
            if p is not None and id(p) in owned:
                opt.state[p][slot.key] = torch.as_tensor(value).clone()


def is_parameter_step(name: str) -> bool:
    """Whether ``name`` is an eager optimizer's per-parameter step count (``optim:<param>:step``)."""
    if not name.startswith("optim:"):
        return False
    slot = parse_slot_name(name)
    return slot.path is not None and slot.key == "step"


def with_shared_step(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` plus the captured step's shared ``optim:step`` taken from an eager per-parameter
    ``optim:<param>:step`` when only those are present (an eager checkpoint loaded by a captured step)."""
    out = dict(state)
    if STEP_SLOT not in out:
        for name, value in state.items():
            if is_parameter_step(name):
                out[STEP_SLOT] = value
                break
    return out


def shared_step_layout(state: Mapping[str, _T], agree: Callable[[_T, _T], bool]) -> dict[str, _T]:
    """``state`` in the captured step's layout, so eager and captured states compare slot by slot: eager's
    per-parameter step counts become the one shared ``optim:step`` when ``agree`` says they are all equal
    (one eager run steps every parameter together); otherwise they stay, and show up as differences."""
    steps = [k for k in state if is_parameter_step(k)]
    if not steps or STEP_SLOT in state or not all(agree(state[steps[0]], state[k]) for k in steps):
        return dict(state)
    out = {k: v for k, v in state.items() if k not in steps}
    out[STEP_SLOT] = state[steps[0]]
    return out
