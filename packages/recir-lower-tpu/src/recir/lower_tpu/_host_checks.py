"""Lowerings of RecIR's data-check ops: the check runs on the host through ``jax.experimental.io_callback``.

``recir::check_jagged`` validates ids and lengths and returns the values; a failed check raises
recir-embedding's DataError inside the callback, which ``TPUCompiledStep`` re-raises as a DataError.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import torch
from jax.experimental import io_callback

from ._registry import register_jax_lowering


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
