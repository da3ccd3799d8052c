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
from recir.transforms import StepGraph

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


def host_checks_of(step: StepGraph) -> list[HostCheck]:
    """The step's ``recir::check_jagged`` nodes as host checks. A check whose values or lengths are not
    batch inputs as they are (computed in the graph) cannot run before the step: it is logged, not kept."""
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    num_state = len(step.signature.state)
    batch_index = {n: i - num_state for i, n in enumerate(placeholders) if i >= num_state}
    checks = []
    for node in step.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.recir.check_jagged.default:
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
