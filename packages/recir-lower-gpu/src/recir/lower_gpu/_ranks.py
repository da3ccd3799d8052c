"""Compile coordination across the ranks of one job that share a compile cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from typing import Any

from recir.transforms import StepGraph


def program_key(step: StepGraph) -> str:
    """A digest of what a rank compiles: the graph's code and its state slots' names, shapes and dtypes."""
    text = step.graph_module.code + repr([(s.name, s.shape, s.dtype) for s in step.signature.state])
    return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def compile_in_turn(step: StepGraph) -> Iterator[None]:
    """Compile ``step`` inside this block on every rank; identical programs compile once per machine.

    When every rank holds the same program (data parallel), each machine's first local rank
    (``LOCAL_RANK`` 0) compiles first, and the others enter the block once it has filled the shared
    compile cache (``GPUOptions.cache_dir``), so they read its artifacts instead of compiling the same
    graph at once on the same cores. When the ranks' programs differ (sharded tables), every rank
    compiles at once. Collective: every rank of the default process group enters it; without an
    initialised group it does nothing.

    >>> with compile_in_turn(dstep):  # doctest: +SKIP
    ...     compiled = recir.lower_gpu.compile(dstep, plan)
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, program_key(step))
    if len(set(keys)) > 1:
        yield
        return
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    if not first:
        dist.barrier()  # until every machine's first rank has filled its cache
    try:
        yield
    finally:
        if first:
            dist.barrier()
