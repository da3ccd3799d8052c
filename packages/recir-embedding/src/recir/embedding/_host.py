"""The host side of a split step: a ``HostSplit``'s lookups and row updates run eagerly by PyTorch on the
CPU, with the tables updated in place, so a step costs O(ids in the batch), never O(table rows).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import (
    REGION_KEY,
    ConfigError,
    StepGraph,
    Transform,
    TransformResult,
    register_transform,
    verify,
    verify_level,
)
from torch import Tensor

from ._backends import _apply_backend, _copy
from ._transforms.split_host import HOST_SPLIT_KEY, HostSplit, split_host

log = logging.getLogger("recir.embedding")
HOST_KERNELS = ("fbgemm", "torchrec")
_INDEX_PUT = torch.ops.aten.index_put.default


class HostEmbeddings:
    """Runs a ``HostSplit``'s host parts on the CPU: ``lookup`` before the device step, ``update`` after.

    ``kernels``: the lookups' CPU kernels, ``fbgemm`` (FBGEMM's table-batched kernel; the default when
    FBGEMM is installed) or ``torchrec`` (``nn.EmbeddingBag``/``nn.Embedding``, what an unsharded TorchRec
    module runs). ``update`` writes each table and optimizer-state slot in place: its functional
    ``index_put(slot, [rows], delta, accumulate=True)`` runs as ``index_put_`` (nothing reads the slot
    after it); a slot computed any other way is copied back (O(rows), logged once at construction).
    ``threads``: PyTorch's intra-op threads while the host parts run (then put back; None: leave them).
    One by default: the host work per step is small, and PyTorch's OpenMP pool and JAX's CPU threads
    contend for the same cores (measured at the DLRMv3 smoke size on a 2-core CPU, JAX on its CPU
    backend: 167 ms/step with PyTorch's default 2 threads, 9 ms with 1).
    """

    def __init__(self, split: HostSplit, kernels: str | None = None, threads: int | None = 1) -> None:
        if kernels is None:
            kernels = "fbgemm" if importlib.util.find_spec("fbgemm_gpu") is not None else "torchrec"
        if kernels not in HOST_KERNELS:
            raise ConfigError(f"host embedding kernels {kernels!r}: choose one of {HOST_KERNELS}")
        self.split = split
        self.kernels = kernels
        lookup = _copy(split.lookup)
        for node in lookup.graph.nodes:  # no longer "to be split": let the backend retarget them
            node.meta.pop(REGION_KEY, None)
        _apply_backend(lookup, kernels, "gpu", keep_checks=False)
        lookup.graph_module.recompile()
        self._lookup = lookup.graph_module
        self._update, copied = _in_place(split.update)
        for name in copied:
            log.warning("recir.embedding: host slot %s is copied back after each update (O(rows))", name)
        self._n_host = len(split.host_slots)
        self.threads = threads

    def lookup(self, host_state: Sequence[Tensor], flat_batch: Sequence[Tensor]) -> list[Tensor]:
        """The looked-up rows, one tensor per lookup (the device part's extra batch inputs)."""
        with torch.no_grad(), _torch_threads(self.threads):
            out = self._lookup(*host_state, *flat_batch)
        return list(out[self._n_host :])

    def update(
        self, host_state: Sequence[Tensor], flat_batch: Sequence[Tensor], boundary: Sequence[Tensor]
    ) -> None:
        """Apply the tables' row updates to ``host_state`` in place, given the device's boundary outputs."""
        with torch.no_grad(), _torch_threads(self.threads):
            out = self._update(*host_state, *flat_batch, *boundary)
            for slot, new in zip(host_state, out):
                if new is not slot:
                    slot.copy_(new)


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """PyTorch's intra-op thread count set to ``n`` for the block, then put back."""
    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _in_place(part: StepGraph) -> tuple[fx.GraphModule, list[str]]:
    """A copy of the update part whose accumulating ``index_put`` into a state slot writes the slot itself.

    Not a StepGraph any more (INV-2 forbids mutation): an execution detail, like the GPU lowering's
    ``copy_`` epilogue. Returns the module and the slots still updated out of place.
    """
    step = _copy(part)
    graph = step.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outs = list(graph.output_node().args[0])
    copied = []
    for i, (slot, value) in enumerate(zip(step.signature.state, outs)):
        ph = placeholders[i]
        if value is ph:
            continue
        ok = (
            value.op == "call_function"
            and value.target == _INDEX_PUT
            and value.args[0] is ph
            and len(value.args) == 4
            and value.args[3] is True
            and all(order[u] < order[value] for u in ph.users if u is not value)
        )
        if ok:
            value.target = torch.ops.aten.index_put_.default
        else:
            copied.append(slot.name)
    step.graph_module.recompile()
    return step.graph_module, copied


@register_transform
class CutHostSplit(Transform):
    """Cut a step marked by ``recir-embed-split-host`` at its embedding boundary and continue with the
    device part: the rest of the lowering pipeline compiles only what runs on the device.

    The three parts (``split_host``) are kept on the transform (``self.split``) for the runtime that
    chains them (``HostEmbeddings`` or ``FusedTBE`` around the compiled device part)::

        (state, batch) -> (new_state, outputs)                                         # before
        (device state, batch + rows) -> (new device state, outputs + row gradients...)  # after
    """

    name = "recir-embed-cut-host-split"
    summary = "cut a host-split-marked step at the embedding boundary; continue with the device part"

    def __init__(self, options: Any | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.split: HostSplit | None = None

    def requires(self, step: StepGraph) -> None:
        if HOST_SPLIT_KEY not in step.meta:
            raise ConfigError(f"{self.name}: run recir-embed-split-host first (the step has no host split)")

    def run(self, step: StepGraph) -> TransformResult:
        split = split_host(step)
        if verify_level() >= 1:  # the host parts leave the pipeline here: verify them now
            for name, part in (("lookup", split.lookup), ("update", split.update)):
                verify(part, transform=f"{self.name} ({name} part)")
        self.split = split
        stats = {
            "host_tables": len(split.tables),
            "lookups": len(split.lookup_tables),
            "row_grads": split.row_grads,
            "boundary": len(split.device.signature.outputs) - len(step.signature.outputs),
        }
        return TransformResult(split.device, True, stats)
