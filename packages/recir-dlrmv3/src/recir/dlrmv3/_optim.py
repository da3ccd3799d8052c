"""The reference's optimizers: dense Adam (lr 1e-3, betas 0.95/0.999, eps 1e-8) and row-wise Adagrad
(lr 1e-3, eps 1e-8) for the embedding tables (their slot-named state: recir.capture.state_from / load_into).
"""

from __future__ import annotations

import torch
from recir.embedding import RowWiseAdagrad
from recir.transforms import ConfigError
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
        opts.append(RowWiseAdagrad([p for _, p in tables], lr=sparse_lr, eps=1e-8))
    return opts
