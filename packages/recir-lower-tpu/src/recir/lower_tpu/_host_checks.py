"""RecIR's data checks on the TPU path.

``recir::check_jagged`` validates ids and lengths and returns the values. ``compile`` takes the checks out
of the graph (XLA cannot raise on data) and runs them on the host before each step, on the batch's torch
tensors (:func:`host_checks_of`, :class:`HostCheck`): a bad batch raises recir-embedding's DataError
before anything runs on the device. A graph that keeps a check node gets the lowering below: the check
runs through ``jax.experimental.io_callback``, and ``TPUCompiledStep`` re-raises its failure as a DataError.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import torch
from jax.experimental import io_callback
from recir.transforms import StepGraph, slot_path

from ._registry import register_jax_lowering

logger = logging.getLogger("recir.lower_tpu")


@dataclass(frozen=True)
class HostCheck:
    """One ``recir::check_jagged`` of the captured step, run on the host: the batch leaves holding its
    values and lengths (indices into the flat batch) and its constant arguments."""

    values: int
    lengths: int
    args: tuple[Any, ...]

    def __call__(self, flat_batch: Sequence[Any]) -> None:
        values, lengths = flat_batch[self.values], flat_batch[self.lengths]
        if isinstance(values, torch.Tensor) and isinstance(lengths, torch.Tensor):
            torch.ops.recir.check_jagged.default(values, lengths, *self.args)


@dataclass(frozen=True)
class HostIdCheck:
    """A plain ``nn.Embedding`` / ``nn.EmbeddingBag`` lookup whose ids are a batch input: every id must
    be a row of its table (XLA would clamp an out-of-range id silently)."""

    ids: int
    table: str
    rows: int
    batch_leaf: str

    def __call__(self, flat_batch: Sequence[Any]) -> None:
        ids = flat_batch[self.ids]
        if not isinstance(ids, torch.Tensor) or ids.numel() == 0:
            return
        bad = ((ids < 0) | (ids >= self.rows)).reshape(-1).nonzero()
        if bad.numel():
            from recir.transforms import DataError

            i = int(bad[0, 0])
            raise DataError(
                f"table {self.table!r}: id {int(ids.reshape(-1)[i])} at position {i} of batch leaf "
                f"{self.batch_leaf!r} is outside [0, {self.rows}). Fix: hash or clip ids into the table's "
                "range, or enlarge the table."
            )


_PLAIN_LOOKUPS = ("aten::embedding", "aten::_embedding_bag", "aten::embedding_bag")
_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def _through_aliases(node: Any) -> Any:
    """The node a chain of ``detach`` / ``alias`` (same values, same shape) starts from."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _ALIASES:
        node = node.args[0]
    return node


def host_checks_of(step: StepGraph) -> list[Any]:
    """The step's id checks as host checks: its ``recir::check_jagged`` nodes (TorchRec tables through
    recir-embedding's overrides), and the ids of plain ``aten.embedding`` / ``aten._embedding_bag``
    lookups that read a batch input. A check whose values are computed in the graph cannot run on the
    host before the step: it is logged, not kept."""
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    num_state = len(step.signature.state)
    state_names = step.signature.state_names()
    batch_index = {n: i - num_state for i, n in enumerate(placeholders) if i >= num_state}
    state_index = {n: i for i, n in enumerate(placeholders) if i < num_state}
    checks: list[Any] = []
    seen: set[tuple[int, str]] = set()
    for node in step.graph.nodes:
        if node.op != "call_function":
            continue
        name = node.target.name() if isinstance(node.target, torch._ops.OpOverload) else ""
        if name.split(".")[0] in _PLAIN_LOOKUPS and len(node.args) >= 2:
            weight, ids = _through_aliases(node.args[0]), _through_aliases(node.args[1])
            if ids in batch_index and weight in state_index:
                slot = state_names[state_index[weight]]
                key = (batch_index[ids], slot)
                if key not in seen:
                    seen.add(key)
                    rows = int(weight.meta["val"].shape[0])
                    leaf = step.signature.batch[batch_index[ids]].name
                    checks.append(HostIdCheck(batch_index[ids], str(slot_path(slot)), rows, leaf))
            continue
        if node.target is not torch.ops.recir.check_jagged.default:
            continue
        values, lengths, *rest = node.args
        if values in batch_index and lengths in batch_index:
            checks.append(HostCheck(batch_index[values], batch_index[lengths], tuple(rest)))
        else:
            logger.warning(
                "recir.lower_tpu: the id check %s reads values computed in the graph, not batch inputs; "
                "it cannot run on the host before the step and is skipped (validate such batches with "
                "recir.embedding.validate_batch)",
                node.name,
            )
    return checks


@register_jax_lowering("recir::check_jagged")
def recir_check_jagged(
    values,
    lengths,
    batch_size: int,
    capacities: Sequence[int],
    num_rows: Sequence[int],
    features: str,
    tables: str,
):
    def host_check(v: np.ndarray, ln: np.ndarray) -> np.ndarray:
        torch.ops.recir.check_jagged.default(
            torch.from_numpy(np.array(v)),
            torch.from_numpy(np.array(ln)),
            batch_size,
            list(capacities),
            list(num_rows),
            features,
            tables,
        )
        return np.asarray(v)

    # The returned values feed the lookups, so the check runs before any id is used.
    return io_callback(host_check, jax.ShapeDtypeStruct(values.shape, values.dtype), values, lengths)
