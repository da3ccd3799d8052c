"""The reference's optimizers: dense Adam (lr 1e-3, betas 0.95/0.999, eps 1e-8) and row-wise Adagrad
(lr 1e-3, eps 1e-8) for the embedding tables, plus flat slot-named views of their state.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from recir.transforms import ConfigError
from torch import nn

from ._config import TABLE_OPTIMIZERS

TABLE_PREFIX = "ec."


def split_params(model: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(dense, table) named parameters; tables are the EmbeddingCollection's weights."""
    dense, tables = [], []
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
    model: nn.Module,
    lr: float,
    sparse_lr: float,
    table_optimizer: str = "rowwise_adagrad",
    target: str = "eager",
) -> list[torch.optim.Optimizer]:
    """[dense Adam, table row-wise Adagrad], or with `table_optimizer="adam"` one Adam whose second
    param group holds the tables (what a single captured optimizer can express today). "auto" is
    row-wise Adagrad on the eager target and Adam on the compiled ones."""
    if table_optimizer == "auto":
        table_optimizer = "rowwise_adagrad" if target == "eager" else "adam"
    dense, tables = split_params(model)
    adam = {"betas": (0.95, 0.999), "eps": 1e-8}
    if table_optimizer == "adam":
        groups = [{"params": [p for _, p in dense], "lr": lr}]
        if tables:
            groups.append({"params": [p for _, p in tables], "lr": sparse_lr})
        return [torch.optim.Adam(groups, lr=lr, **adam)]
    if table_optimizer != "rowwise_adagrad":
        raise ConfigError(
            f"unknown --table_optimizer {table_optimizer!r}; expected one of {', '.join(TABLE_OPTIMIZERS)}"
        )
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
                    out[f"optim:{names[id(p)]}:{key}"] = value
    return out


def load_optimizer_state(
    model: nn.Module, optimizers: list[torch.optim.Optimizer], state: Mapping[str, torch.Tensor]
) -> None:
    """Inverse of `optimizer_state` (copies the tensors in)."""
    params = dict(model.named_parameters())
    for opt in optimizers:
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        for name, value in state.items():
            if not name.startswith("optim:"):
                continue
            pname, key = name[len("optim:") :].rsplit(":", 1)
            p = params.get(pname)
            if p is not None and id(p) in owned:
                opt.state[p][key] = value.clone()
