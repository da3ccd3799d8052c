"""Embedding table configuration: one table, its features, pooling, optimizer and initialisation.

Tables can be declared directly or read from TorchRec modules (``tables_from_torchrec``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch
from recir.transforms import ConfigError
from torch import nn

Pooling = Literal["sum", "mean", "none"]
POOLINGS: tuple[str, ...] = ("sum", "mean", "none")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad", "adam")


@dataclasses.dataclass(frozen=True)
class EmbeddingTable:
    """One embedding table: ``num_embeddings`` rows of ``dim`` floats, looked up by ``features``.

    ``pooling`` is ``"sum"``/``"mean"`` (one vector per bag) or ``"none"`` (one vector per id).
    ``optimizer`` names the row-wise optimizer (``sgd``, ``adagrad``, ``rowwise_adagrad``, ``adam``)
    with its ``hparams`` (``lr``, ``eps``, ``betas``, ...); ``init`` is ``("uniform", lo, hi)`` or
    ``("normal", mean, std)``.
    """

    name: str
    num_embeddings: int
    dim: int
    features: tuple[str, ...]
    pooling: Pooling = "sum"
    optimizer: str = "sgd"
    hparams: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    init: tuple[Any, ...] = ("uniform", -0.05, 0.05)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "features", tuple(self.features))
        if self.num_embeddings <= 0 or self.dim <= 0:
            raise ConfigError(
                f"table {self.name!r}: num_embeddings and dim must be positive, "
                f"got {self.num_embeddings} x {self.dim}"
            )
        if not self.features:
            raise ConfigError(f"table {self.name!r}: needs at least one feature")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"table {self.name!r}: pooling {self.pooling!r} is not one of {POOLINGS}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"table {self.name!r}: optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")

    def init_weight(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """A freshly initialised ``[num_embeddings, dim]`` weight."""
        w = torch.empty(self.num_embeddings, self.dim, dtype=self.dtype)
        kind, a, b = self.init
        if kind == "uniform":
            return w.uniform_(a, b, generator=generator)
        if kind == "normal":
            return w.normal_(a, b, generator=generator)
        raise ConfigError(f"table {self.name!r}: init {self.init!r} must be ('uniform'|'normal', a, b)")


def feature_to_table(tables: Iterable[EmbeddingTable]) -> dict[str, EmbeddingTable]:
    """Feature name -> the table it looks up (a feature may appear in one table only)."""
    out: dict[str, EmbeddingTable] = {}
    for t in tables:
        for f in t.features:
            if f in out and out[f].name != t.name:
                raise ConfigError(
                    f"feature {f!r} is looked up by tables {out[f].name!r} and {t.name!r}; "
                    "a feature feeds one table (share a table by listing several features on it)"
                )
            out[f] = t
    return out


def tables_from_torchrec(module: nn.Module) -> list[EmbeddingTable]:
    """The tables of a TorchRec ``EmbeddingBagCollection`` or ``EmbeddingCollection``."""
    if hasattr(module, "embedding_bag_configs"):
        configs, pooled = module.embedding_bag_configs(), True
    elif hasattr(module, "embedding_configs"):
        configs, pooled = module.embedding_configs(), False
    else:
        raise ConfigError(
            f"{type(module).__name__} is not a TorchRec EmbeddingBagCollection/EmbeddingCollection"
        )
    tables = []
    for c in configs:
        pooling: Pooling = c.pooling.value.lower() if pooled else "none"
        tables.append(
            EmbeddingTable(c.name, c.num_embeddings, c.embedding_dim, tuple(c.feature_names), pooling=pooling)
        )
    return tables
