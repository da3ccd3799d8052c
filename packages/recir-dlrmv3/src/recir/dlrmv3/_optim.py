"""The reference's optimizers: dense Adam (lr 1e-3, betas 0.95/0.999, eps 1e-8) and row-wise Adagrad
(lr 1e-3, eps 1e-8) for the embedding tables, plus flat slot-named views of their state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from recir.transforms import STEP_SLOT, ConfigError, optim_slot, parse_slot_name
from torch import nn

from ._config import OPTIMIZERS

TABLE_PREFIX = "ec."


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(dense, table) named parameters; tables are the EmbeddingCollection's weights."""
    dense: list[tuple[str, nn.Parameter]] = []
    tables: list[tuple[str, nn.Parameter]] = []
    for name, p in model.named_parameters():
        (tables if name.startswith(TABLE_PREFIX) else dense).append((name, p))
    return dense, tables


def rowwise_adagrad_class() -> type[torch.optim.Optimizer]:
    """recir.capture's RowWiseAdagrad when installed, else torch's Adagrad."""
    try:
        from recir.capture import RowWiseAdagrad

        return RowWiseAdagrad
    except ImportError:
        return torch.optim.Adagrad


def make_optimizers(
    model: nn.Module, lr: float, sparse_lr: float, optimizer: str = "reference", target: str = "eager"
) -> list[torch.optim.Optimizer]:
    """The optimizers of `--optimizer`:

    - `reference`: dense Adam + row-wise Adagrad on the tables (two optimizers, as in the reference);
    - `adam`: one Adam, tables in a second param group (compiled paths update only the rows a batch
      touches, i.e. lazy Adam on the tables, so eager and compiled differ on untouched rows);
    - `adagrad`: one Adagrad, tables in a second param group (row-sparse updates are exact).
    (`auto`, the old default, meant `reference` on every target; checkpoints that record it resume.)
    """
    del target  # every target trains the reference pair
    if optimizer == "auto":
        optimizer = "reference"
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown --optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    dense, tables = split_params(model)
    adam = {"betas": (0.95, 0.999), "eps": 1e-8}
    if optimizer in ("adam", "adagrad"):
        groups = [{"params": [p for _, p in dense], "lr": lr}]
        if tables:
            groups.append({"params": [p for _, p in tables], "lr": sparse_lr})
        if optimizer == "adam":
            return [torch.optim.Adam(groups, lr=lr, **adam)]
        return [torch.optim.Adagrad(groups, lr=lr, eps=1e-8)]
    opts: list[torch.optim.Optimizer] = [torch.optim.Adam([p for _, p in dense], lr=lr, **adam)]
    if tables:
        opts.append(rowwise_adagrad_class()([p for _, p in tables], lr=sparse_lr, eps=1e-8))
    return opts


def optimizer_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """`optim:<param>:<key>` -> tensor for every populated optimizer state entry."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for opt in optimizers:
        for p, st in opt.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[optim_slot(names[id(p)], key)] = value
    return out


def load_optimizer_state(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], state: Mapping[str, torch.Tensor]
) -> None:
    """Inverse of `optimizer_state` (copies the tensors in)."""
    params = dict(model.named_parameters())
    for opt in optimizers:
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        for name, value in state.items():
            if name == SHARED_STEP:  # a captured step's one Adam step count: every Adam param's `step`
                if isinstance(opt, torch.optim.Adam):
                    for g in opt.param_groups:
                        for p in g["params"]:
                            opt.state[p]["step"] = value.detach().clone().reshape(())
                continue
            slot = parse_slot_name(name) if name.startswith("optim:") else None
            if slot is None or slot.path is None or slot.key is None:
                continue
            pname, key = slot.path, slot.key
            p = params.get(pname)
            if p is not None and id(p) in owned:
                opt.state[p][key] = value.clone()


SHARED_STEP = STEP_SLOT


def with_shared_step(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` plus the captured step's shared `optim:step` taken from an eager per-parameter
    `optim:<param>:step` when only those are present (an eager checkpoint loaded by a captured step)."""
    out = dict(state)
    if SHARED_STEP not in out:
        for name, value in state.items():
            if is_parameter_step(name):
                out[SHARED_STEP] = value
                break
    return out


_T = TypeVar("_T")


def is_parameter_step(name: str) -> bool:
    """Whether `name` is an eager optimizer's per-parameter step count (`optim:<param>:step`)."""
    if not name.startswith("optim:"):
        return False
    slot = parse_slot_name(name)
    return slot.path is not None and slot.key == "step"


def shared_step_layout(state: Mapping[str, _T], agree: Callable[[_T, _T], bool]) -> dict[str, _T]:
    """`state` in the captured step's layout, so eager and captured states compare slot by slot: eager's
    per-parameter step counts become the one shared `optim:step` when `agree` says they are all equal
    (one eager run steps every parameter together); otherwise they stay, and show up as differences."""
    steps = [k for k in state if is_parameter_step(k)]
    if not steps or SHARED_STEP in state or not all(agree(state[steps[0]], state[k]) for k in steps):
        return dict(state)
    out = {k: v for k, v in state.items() if k not in steps}
    out[SHARED_STEP] = state[steps[0]]
    return out
