"""Embedding backends chosen at lowering time, behind one entry point: ``prepare_for_lowering``.

``fbgemm`` / ``torchrec`` keep lookups as opaque ops at graph boundaries running those libraries'
kernels; ``in_graph`` inlines the pure-ATen reference (traceable: Inductor and torchax see through it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import (
    OPTIMIZER_KEY,
    OVERRIDE_KEY,
    PHASE_KEY,
    REGION_KEY,
    ConfigError,
    Pipeline,
    StepGraph,
    Transform,
    TransformResult,
    embedding_bag_reference,
    register_transform,
    splice,
)

from . import _ops
from . import _ring_shift as _ring_shift  # registers the recir::ring_shift_* ops
from ._checks import checks_enabled
from ._quantized_lookup import quantized_lookup_reference
from ._transforms.sparsify_update import SparsifyUpdate
from ._transforms.split_host import HOST_LOOKUP, SplitHostEmbeddings
from ._versions import check_fbgemm

log = logging.getLogger("recir.embedding")
BACKENDS: tuple[str, ...] = ("fbgemm", "torchrec", "in_graph", "ring_shift", "cpu")
TARGETS: tuple[str, ...] = ("gpu", "tpu")

_BAG = torch.ops.recir.embedding_bag.default
_SEQ = torch.ops.recir.embedding.default
_CHECK = torch.ops.recir.check_jagged.default
_QUANTIZED = torch.ops.recir.quantized_lookup.default
_SAME = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default}
_BAG_OPS = {
    _BAG,
    torch.ops.recir.fbgemm_embedding_bag.default,
    torch.ops.recir.torchrec_embedding_bag.default,
}
_SEQ_OPS = {_SEQ, torch.ops.recir.fbgemm_embedding.default, torch.ops.recir.torchrec_embedding.default}


def default_backend(target: str, device: Any = None) -> str:
    """``fbgemm`` for a CUDA GPU target when FBGEMM's CUDA build is installed, ``in_graph`` elsewhere
    (CPU, TPU, and CUDA with only ``fbgemm-gpu-cpu`` or no FBGEMM at all)."""
    if target == "gpu":
        dev = torch.device(device) if device is not None else None
        cuda = dev.type == "cuda" if dev is not None else torch.cuda.is_available()
        if cuda and _ops.fbgemm_has_cuda():
            return "fbgemm"
    return "in_graph"


def _copy(step: StepGraph) -> StepGraph:
    return step.copy()


def _require(backend: str, target: str, device: Any, row_sharded: Mapping[str, str] | None) -> None:
    dev = torch.device(device) if device is not None else None
    if backend in ("fbgemm", "torchrec") and target == "tpu":
        raise ConfigError(
            f"embedding backend {backend!r} cannot run on target 'tpu': its kernels are torch/CUDA "
            "kernels outside the XLA graph. Fix: use backend='in_graph' (or 'ring_shift') for TPU."
        )
    if backend == "fbgemm":
        _ops._fbgemm()  # ImportError naming the extra to install
        if dev is not None and dev.type not in ("cpu", "cuda"):
            raise ConfigError(f"embedding backend 'fbgemm' runs on cpu or cuda, not {dev.type!r}")
        if dev is not None and dev.type == "cuda" and not _ops.fbgemm_has_cuda():
            raise ConfigError(
                "embedding backend 'fbgemm' on CUDA needs FBGEMM's CUDA kernels, and the installed FBGEMM "
                "has none (fbgemm-gpu-cpu, the CPU build). Fix: install recir-embedding[fbgemm-gpu] "
                "(fbgemm-gpu built for this torch and CUDA), or use embedding_backend='in_graph'."
            )
    if backend == "torchrec":
        check_fbgemm()  # TorchRec imports FBGEMM: a FBGEMM built for another torch fails inside it
        try:
            import torchrec  # noqa: F401
        except ImportError as e:  # pragma: no cover
            raise ImportError(
                "the 'torchrec' embedding backend needs TorchRec: install recir-embedding[torchrec]"
            ) from e
    if backend == "cpu" and target != "tpu":
        raise ConfigError(
            "embedding backend 'cpu' (tables on the host, the dense step on the device) is built for the "
            f"TPU path; target is {target!r}. Fix: on the GPU path use 'fbgemm' (FBGEMM's fused TBE trains "
            "the tables at the same embedding boundary), 'torchrec' or 'in_graph'."
        )
    if backend == "ring_shift":
        if target != "tpu":
            raise ConfigError(
                "embedding backend 'ring_shift' is the TPU path (JAX/Pallas over row-sharded tables); "
                f"target is {target!r}. Fix: use 'fbgemm', 'torchrec' or 'in_graph' on GPU."
            )
        _require_lower_tpu()
        if not row_sharded:
            raise ConfigError(
                "embedding backend 'ring_shift' needs row-wise sharded tables on a mesh, and none were given "
                "(row_sharded is empty). Fix: compile with a recir.distributed plan that shards the tables "
                "row-wise, e.g. recir.lower_tpu.compile(step, rd.plan(step, rd.row_wise(), mesh, "
                "batch='global'), mesh=..., embedding_backend='ring_shift'), or use backend='in_graph'."
            )


def _require_lower_tpu() -> None:
    """The ring_shift ops are lowered by recir.lower_tpu (JAX); found without importing either."""
    missing = [m for m in ("jax", "recir.lower_tpu") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"the 'ring_shift' embedding backend needs JAX and recir-lower-tpu, which lowers its ops "
            f"(missing: {', '.join(missing)}). Fix: install recir-lower-tpu (it brings jax and torchax)."
        )


def _inline(step: StepGraph, node: fx.Node, fn: Callable[..., Any], args: list[fx.Node]) -> None:
    (new,) = splice(
        step.graph,
        lambda *xs: (fn(*xs),),
        args,
        before=node,
        phase=node.meta.get(PHASE_KEY, "forward"),
        provenance="recir-embedding-in-graph",
    )
    node.replace_all_uses_with(new)
    step.graph.erase_node(node)


def _bag_reference(extra: tuple[Any, ...]) -> Callable[..., torch.Tensor]:
    psw_is_none, mode = extra
    if psw_is_none:
        return lambda w, i, o: embedding_bag_reference(w, i, o, None, mode)
    return lambda w, i, o, p: embedding_bag_reference(w, i, o, p, mode)


def _quantized_reference(
    psw_is_none: bool, pooling: int, dim: int, qtype: int
) -> Callable[..., torch.Tensor]:
    if psw_is_none:
        return lambda t, i, o: quantized_lookup_reference(t, i, o, None, pooling, dim, qtype)
    return lambda t, i, o, p: quantized_lookup_reference(t, i, o, p, pooling, dim, qtype)


def _table_slot(step: StepGraph, weight: Any) -> str | None:
    """The state slot a lookup's weight argument is (its placeholder, through detach/alias), or None."""
    while isinstance(weight, fx.Node) and weight.op == "call_function" and weight.target in _SAME:
        weight = weight.args[0]
    if not isinstance(weight, fx.Node) or weight.op != "placeholder":
        return None
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    i = placeholders.index(weight)
    state = step.signature.state
    return state[i].name if i < len(state) else None


def _ring_axis(step: StepGraph, node: fx.Node, row_sharded: Mapping[str, str]) -> str:
    slot = _table_slot(step, node.args[0])
    if slot is None or slot not in row_sharded:
        table = slot or getattr(node.args[0], "name", repr(node.args[0]))
        raise ConfigError(
            f"embedding backend 'ring_shift': lookup %{node.name} reads table {table!r}, which is not "
            f"row-wise sharded (row-sharded tables: {sorted(row_sharded)}). Fix: shard it row-wise in the "
            "plan (recir.distributed.row_wise(...)), or use backend='in_graph'."
        )
    return row_sharded[slot]


def _apply_backend(
    step: StepGraph,
    backend: str,
    target: str,
    keep_checks: bool | None,
    row_sharded: Mapping[str, str] | None = None,
    keep_quantized: bool = False,
) -> dict[str, int]:
    counts = {"lookups": 0, "checks_removed": 0}
    if keep_checks is None:
        keep_checks = target == "gpu" and checks_enabled()
    drop_checks = not keep_checks
    for node in list(step.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == _CHECK and drop_checks:
            # XLA cannot raise on data: recir.lower_tpu.compile runs the check on the host before the step.
            node.replace_all_uses_with(node.args[0])
            step.graph.erase_node(node)
            counts["checks_removed"] += 1
        elif node.target == _QUANTIZED:
            counts["quantized_lookups"] = counts.get("quantized_lookups", 0) + 1
            if not keep_quantized:  # else the lowering calls FBGEMM's inference TBE (lower_quantized_lookups)
                packed, indices, offsets, psw, pooling, dim, qtype = node.args
                tensors = [packed, indices, offsets] + ([psw] if psw is not None else [])
                _inline(step, node, _quantized_reference(psw is None, pooling, dim, qtype), tensors)
        elif HOST_LOOKUP in (node.meta.get(REGION_KEY) or ()):
            counts["host_lookups"] = counts.get("host_lookups", 0) + 1  # split_host runs them on the host
        elif node.target in _BAG_OPS:
            counts["lookups"] += 1
            if backend == "in_graph":
                w, i, o, p, mode = node.args
                _inline(
                    step, node, _bag_reference((p is None, mode)), [w, i, o] + ([p] if p is not None else [])
                )
            else:
                if backend == "ring_shift":
                    node.args = (*node.args, _ring_axis(step, node, row_sharded or {}))
                node.target = getattr(torch.ops.recir, f"{backend}_embedding_bag").default
                node.meta[OVERRIDE_KEY] = f"recir-embedding-{backend}"
        elif node.target in _SEQ_OPS:
            counts["lookups"] += 1
            if backend == "in_graph":
                _inline(step, node, _ops.embedding_reference, list(node.args))
            else:
                if backend == "ring_shift":
                    node.args = (*node.args, _ring_axis(step, node, row_sharded or {}))
                node.target = getattr(torch.ops.recir, f"{backend}_embedding").default
                node.meta[OVERRIDE_KEY] = f"recir-embedding-{backend}"
    if backend == "ring_shift":
        counts["row_updates"] = _ring_row_updates(step, row_sharded or {})
    return counts


_INDEX_SELECT = torch.ops.aten.index_select.default
_INDEX_PUT = torch.ops.aten.index_put.default


def _ring_row_updates(step: StepGraph, row_sharded: Mapping[str, str]) -> int:
    """The sparse row update's reads and writes of row-sharded slots (tables and their row-wise optimizer
    state) become ring ops: ``index_select(slot, 0, rows)`` -> ``recir::ring_shift_embedding``, and
    ``index_put(slot, [rows], delta, accumulate=True)`` -> ``recir::ring_shift_index_add``, so the rows
    are read from and added into their owner shards."""
    changed = 0
    for node in list(step.graph.nodes):
        if node.op != "call_function" or node.target not in (_INDEX_SELECT, _INDEX_PUT):
            continue
        slot = _table_slot(step, node.args[0])
        if slot is None or slot not in row_sharded:
            continue
        axis = row_sharded[slot]
        if node.target == _INDEX_SELECT and node.args[1] == 0:
            node.target = torch.ops.recir.ring_shift_embedding.default
            node.args = (node.args[0], node.args[2], axis)
        elif (
            node.target == _INDEX_PUT
            and len(node.args) == 4
            and node.args[3] is True
            and len(node.args[1]) == 1
        ):
            node.target = torch.ops.recir.ring_shift_index_add.default
            node.args = (node.args[0], node.args[1][0], node.args[2], axis)
        else:
            continue
        node.meta[OVERRIDE_KEY] = "recir-embedding-ring_shift"
        changed += 1
    return changed


def _warn_dense_tables(stats: Mapping[str, Any]) -> None:
    """One warning per table that keeps its dense gradient and update (O(rows) work every step)."""
    tables = stats.get("tables", {})
    for slot, reason in stats.get("dense_tables", {}).items():
        log.warning(
            "recir.embedding: table %s (module %r) keeps a dense update, O(rows) work per step instead of "
            "O(ids in the batch): %s",
            slot,
            tables.get(slot, ""),
            reason,
        )


@register_transform
class ApplyEmbeddingBackend(Transform):
    """Retarget a step's lookups to an embedding backend's kernels.

    ``fbgemm`` / ``torchrec``: each ``recir::embedding_bag`` / ``recir::embedding`` becomes that backend's
    forward-kernel override op (called at a graph boundary); ``in_graph``: the pure-ATen reference is
    inlined; ``ring_shift``: the backend's op carrying the mesh axis of its row-sharded table, and the
    sparse row update's reads/writes of those tables become ring ops. Lookups marked for the host
    (``recir.host:lookup``) are left alone. ``keep_checks=False`` drops ``recir::check_jagged`` nodes::

        %rows = recir.embedding_bag(%W, %ids, %offs, None, 0)         # before
        %rows = recir.fbgemm_embedding_bag(%W, %ids, %offs, None, 0)  # after, backend="fbgemm"
    """

    name = "recir-embed-apply-backend"
    summary = "retarget lookups to the embedding backend's kernels (override ops, or inlined ATen)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        backend: str = "in_graph"
        target: str = "gpu"
        keep_checks: bool = True
        row_sharded: tuple[tuple[str, str], ...] = ()  # (state slot, mesh axis) of row-sharded tables
        keep_quantized: bool = False  # leave recir::quantized_lookup for FBGEMM (else its ATen reference)

    def requires(self, step: StepGraph) -> None:
        if self.options.backend not in BACKENDS or self.options.backend == "cpu":
            raise ConfigError(f"{self.name}: backend {self.options.backend!r} has no lookup kernels")
        if self.options.target not in TARGETS:
            raise ConfigError(f"{self.name}: target {self.options.target!r} is not one of {TARGETS}")

    def run(self, step: StepGraph) -> TransformResult:
        o = self.options
        counts = _apply_backend(
            step, o.backend, o.target, o.keep_checks, dict(o.row_sharded), keep_quantized=o.keep_quantized
        )
        step.graph.eliminate_dead_code()
        step.graph.lint()
        step.graph_module.recompile()
        inlined = counts.get("quantized_lookups") and not o.keep_quantized
        changed = bool(inlined) or any(counts.get(k) for k in ("lookups", "checks_removed", "row_updates"))
        return TransformResult(step, changed, counts)


def embedding_transforms(
    step: StepGraph,
    *,
    backend: str,
    target: str,
    keep_checks: bool,
    sparse_updates: bool = True,
    row_sharded: Mapping[str, str] | None = None,
    host_tables: bool | Sequence[str] = False,
    keep_quantized: bool = False,
) -> list[Transform]:
    """recir-embedding's part of a lowering pipeline, every choice an option: sparse row-wise updates
    (when asked and the step has a captured optimizer), the host split's marking (``host_tables``, and
    always for ``backend="cpu"``), then the backend's kernels for the other lookups."""
    out: list[Transform] = []
    if sparse_updates and OPTIMIZER_KEY in step.meta:
        out.append(SparsifyUpdate())
    if backend == "cpu" or host_tables is not False:
        only = None if isinstance(host_tables, bool) else tuple(host_tables)
        out.append(SplitHostEmbeddings(tables=only))
    rows = tuple(sorted((row_sharded or {}).items())) if backend == "ring_shift" else ()
    kernels = "in_graph" if backend == "cpu" else backend
    out.append(
        ApplyEmbeddingBackend(
            backend=kernels,
            target=target,
            keep_checks=keep_checks,
            row_sharded=rows,
            keep_quantized=keep_quantized,
        )
    )
    return out


def resolve_backend(
    backend: str | None, target: str, device: Any = None, row_sharded: Mapping[str, str] | None = None
) -> str:
    """``backend`` (or the target's default) checked against what is installed: ConfigError/ImportError
    naming the fix when it cannot run."""
    if target not in TARGETS:
        raise ConfigError(f"target {target!r} is not one of {TARGETS}")
    name = backend or default_backend(target, device)
    if name not in BACKENDS:
        raise ConfigError(f"unknown embedding backend {name!r}; choose one of {BACKENDS}")
    _require(name, target, device, row_sharded)
    return name


def embedding_report(pipeline: Pipeline, backend: str, target: str) -> dict[str, Any]:
    """What recir-embedding's transforms did in a pipeline run (``step.meta["recir.embedding"]``), with
    one warning per table left dense or left on the device."""
    report: dict[str, Any] = {"backend": backend, "target": target}
    for rec in pipeline.records:
        if rec.name == SparsifyUpdate.name:
            report["sparsify"] = dict(rec.stats)
            _warn_dense_tables(report["sparsify"])
        elif rec.name == SplitHostEmbeddings.name:
            report["host_split"] = dict(rec.stats)
            for slot, reason in report["host_split"].get("skipped", {}).items():
                log.warning(
                    "recir.embedding: table %s stays on the device (embedding backend %r): %s",
                    slot,
                    backend,
                    reason,
                )
        elif rec.name == ApplyEmbeddingBackend.name:
            report.update(rec.stats)
    return report


def prepare_for_lowering(
    step: StepGraph,
    *,
    backend: str | None = None,
    target: str = "gpu",
    device: Any = None,
    sparse_updates: bool = True,
    keep_checks: bool | None = None,
    row_sharded: Mapping[str, str] | None = None,
    host_tables: bool | Sequence[str] = False,
    keep_quantized: bool = False,
) -> StepGraph:
    """The StepGraph a lowering compiles: sparse row-wise updates, then the chosen embedding backend.

    ``backend``: ``fbgemm`` | ``torchrec`` | ``in_graph`` | ``ring_shift`` | ``cpu`` | None (``fbgemm`` on CUDA
    with FBGEMM's CUDA build, ``in_graph`` elsewhere); ``target``: ``gpu`` | ``tpu``; ``device``: the torch device (GPU path).
    ``keep_checks``: keep the ``recir::check_jagged`` nodes (run-time id/length checks raising DataError);
    None keeps them on the gpu target while checks are enabled and drops them on tpu (validate batches
    on the host there). Drop them (False) for CUDA graphs: the check reads the ids on the host.
    ``row_sharded``: state slot -> mesh axis of the row-wise sharded tables (``ring_shift`` needs it: its
    lookups become ``recir::ring_shift_*`` ops carrying the axis; a lookup of any other table is a
    ConfigError). ``cpu`` (tpu target): tables whose update is row-wise are marked for the host by
    ``recir-embed-split-host`` and their lookups stay ``recir::*`` ops; ``split_host`` then cuts the
    result into host lookup, device and host update parts. ``host_tables``: mark tables for the host
    split with any backend too (True: every table whose update is row-wise; a sequence: those table
    slots), the backend then rewriting only the other lookups (the GPU path's fused FBGEMM TBE: the
    marked tables' lookups and updates run in FBGEMM outside the compiled graph). ``keep_quantized``: leave
    the ``recir::quantized_lookup`` nodes (tables stored by ``QuantizeTables(kernel="fbgemm")``) for the
    lowering to call FBGEMM's inference TBE (``lower_quantized_lookups``); by default their ATen reference
    is inlined. Never mutates ``step``. Raises ``ConfigError``/``ImportError`` naming the backend when it cannot run.
    ``step.meta["recir.embedding"]`` records the backend and what changed.
    """
    name = resolve_backend(backend, target, device, row_sharded)
    keep = keep_checks if keep_checks is not None else target == "gpu" and checks_enabled()
    if not sparse_updates and OPTIMIZER_KEY in step.meta:
        log.info("recir.embedding: sparse_updates=False: every embedding table keeps its dense update")
    transforms = embedding_transforms(
        step,
        backend=name,
        target=target,
        keep_checks=keep,
        sparse_updates=sparse_updates,
        row_sharded=row_sharded,
        host_tables=host_tables,
        keep_quantized=keep_quantized,
    )
    pipeline = Pipeline(transforms, name="recir.embedding.prepare_for_lowering")
    out = pipeline.run(_copy(step))
    report = embedding_report(pipeline, name, target)
    out.meta["recir.embedding"] = report
    log.info("recir.embedding.prepare_for_lowering: %s", report)
    return out
