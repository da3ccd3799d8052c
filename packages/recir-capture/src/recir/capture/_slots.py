"""Naming and initialising the slots of a captured step: state (params, buffers, optimizer, rng) and batch.

Order: ``param:*``, ``buffer:*``, ``optim:<param>:<key>``, ``optim:step``, ``optim:group<i>:lr``, ``rng:*``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.utils._pytree as pytree
from recir.transforms import (
    RNG_OFFSET_SLOT,
    RNG_SEED_SLOT,
    STEP_SLOT,
    BatchSlot,
    CaptureError,
    ParamOptim,
    StateSlot,
    buffer_slot,
    lr_slot,
    optim_slot,
    param_slot,
    parse_slot_name,
    state_shape,
)
from torch import nn

from ._optim_map import as_optimizer_list


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_name(path: tuple[Any, ...], default: str) -> str:
    return ".".join(_key_name(k) for k in path) or default


_PAYLOAD_WORDS = {"time", "times", "timestamp", "timestamps", "ts", "action", "actions", "mask", "bitmask"}


def guess_role(name: str, dtype: torch.dtype) -> str:
    """A batch leaf's role from its name, then its dtype (a guess; transforms may refine it)."""
    n = name.lower()
    words = set(re.split(r"[^a-z0-9]+", n))
    last = n.rsplit(".", 1)[-1]
    if "label" in n or "target" in n or last in ("y", "click", "clicks"):
        return "label"
    if "length" in n or words & {"lens", "len", "num", "count", "counts"}:
        return "lengths"
    if "offset" in n:
        return "offsets"
    if "weight" in n:
        return "weight"
    if dtype.is_floating_point:
        return "dense"
    if dtype == torch.bool or words & _PAYLOAD_WORDS:
        return "other"  # integer payloads (timestamps, action bitmasks) are not embedding ids
    return "ids"


def batch_slots(example_batch: Any) -> tuple[list[BatchSlot], list[torch.Tensor], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten_with_path(example_batch)
    slots, tensors = [], []
    for path, leaf in leaves:
        name = path_name(path, "batch")
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(
                f"batch leaf {name!r} is a {type(leaf).__name__}, not a tensor; every leaf of example_batch "
                "becomes a graph input.\nFix: make it a tensor, or close over the value in loss_fn."
            )
        slots.append(BatchSlot(name, tuple(leaf.shape), leaf.dtype, guess_role(name, leaf.dtype)))  # type: ignore[arg-type]
        tensors.append(leaf)
    return slots, tensors, spec


def main_device(model: nn.Module) -> torch.device:
    """Where scalar state (step, learning rates, rng) lives: the first parameter's device (CPU if none)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def slot_devices(
    model: nn.Module, slots: list[StateSlot], trainable: list[tuple[str, nn.Parameter, ParamOptim]]
) -> list[torch.device]:
    """The device of each state slot: its tensor's (params, buffers, per-parameter optimizer state), else main."""
    by_name = {param_slot(n): p.device for n, p in model.named_parameters()}
    by_name |= {buffer_slot(n): b.device for n, b in model.named_buffers()}
    for n, p, spec in trainable:
        by_name |= {optim_slot(n, k): p.device for k in spec.state_keys}
    main = main_device(model)
    return [by_name.get(s.name, main) for s in slots]


def state_slots(
    params: list[tuple[str, nn.Parameter]],
    buffers: list[tuple[str, torch.Tensor]],
    trainable: list[tuple[str, nn.Parameter, ParamOptim]],
    num_groups: int,
) -> list[StateSlot]:
    slots = [StateSlot(param_slot(n), "param", tuple(p.shape), p.dtype) for n, p in params]
    slots += [StateSlot(buffer_slot(n), "buffer", tuple(b.shape), b.dtype) for n, b in buffers]
    for name, p, spec in trainable:
        for key in spec.state_keys:
            shape = state_shape(spec.kind, key, tuple(p.shape))
            slots.append(StateSlot(optim_slot(name, key), "optim", shape, p.dtype))
    if any(spec.needs_step for _, _, spec in trainable):
        slots.append(StateSlot(STEP_SLOT, "optim", (), torch.float32))
    slots += [StateSlot(lr_slot(i), "optim", (), torch.float32) for i in range(num_groups)]
    slots.append(StateSlot(RNG_SEED_SLOT, "rng", (), torch.int64))
    slots.append(StateSlot(RNG_OFFSET_SLOT, "rng", (), torch.int64))
    return slots


class OptimizerStateInitializer:
    """SlotInitializer for ``optim:*`` and ``rng:*`` slots: reads ``optimizer.state`` where present.

    Missing optimizer state starts like torch.optim's lazy state (zeros; Adagrad's ``sum`` at
    ``initial_accumulator_value``); learning rates come from ``optimizer.param_groups``.
    """

    def __init__(self, specs: dict[str, ParamOptim], lrs: list[float]) -> None:
        self.specs = specs  # param name -> ParamOptim at capture
        self.lrs = lrs

    def __call__(self, slot: StateSlot, model: nn.Module, optimizer: Any) -> torch.Tensor | None:
        name = slot.name
        device = main_device(model)
        optimizers = as_optimizer_list(optimizer)
        groups = [g for opt in optimizers for g in opt.param_groups]
        if name == RNG_SEED_SLOT:
            return torch.randint(0, 2**31 - 1, (), dtype=torch.int64).to(device)
        if name == RNG_OFFSET_SLOT:
            return torch.zeros((), dtype=torch.int64, device=device)
        if not name.startswith("optim:"):
            return None
        parsed = parse_slot_name(name)
        if parsed.is_step:
            return torch.tensor(_read_step(optimizers), dtype=torch.float32, device=device)
        if parsed.group is not None:
            i = parsed.group
            lr = self.lrs[i]
            if i < len(groups):
                lr = float(groups[i]["lr"])
            return torch.tensor(lr, dtype=torch.float32, device=device)
        if parsed.path is None or parsed.key is None:
            return None
        param_name, key = parsed.path, parsed.key
        spec = self.specs.get(param_name)
        if spec is None:
            return None
        param = model.get_parameter(param_name)
        for opt in optimizers:
            value = opt.state.get(param, {}).get(key)
            if isinstance(value, torch.Tensor):
                return value.detach().to(device=param.device, dtype=slot.dtype).clone().reshape(slot.shape)
        fill = float(spec.hparams.get("initial_accumulator_value", 0.0)) if key == "sum" else 0.0
        return torch.full(slot.shape, fill, dtype=slot.dtype, device=param.device)


def _read_step(optimizers: list[torch.optim.Optimizer]) -> float:
    seen_state = False
    for opt in optimizers:
        for p in (p for group in opt.param_groups for p in group["params"]):
            state = opt.state.get(p, {})
            if "step" in state:
                return float(state["step"])
            seen_state = seen_state or "momentum_buffer" in state
    # SGD keeps no step count: a momentum buffer means at least one step was taken.
    return 1.0 if seen_state else 0.0
