"""FBGEMM's split table-batched embeddings (TBE) with their fused backward + optimizer at a split step's
embedding boundary: the kernel TorchRec trains with, run outside the compiled graph.

A step cut by ``split_host`` hands its tables to :class:`FusedTBE`: ``lookup`` runs TBE's forward on the
batch's ids (the rows the device part reads), ``backward`` feeds TBE the device part's gradients w.r.t.
those rows, and TBE's fused backward applies the captured optimizer to the touched rows in place. The
tables and their optimizer state live in TBE's own buffers; :meth:`FusedTBE.views` exposes them as the
step's state slots (views, so a checkpoint reads what TBE trains).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import ConfigError, StepGraph, optimizer_infos
from torch import Tensor

from ._ops import _fbgemm
from ._transforms.split_host import HOST_SPLIT_KEY, HostSplit

log = logging.getLogger("recir.embedding")
_BAG = torch.ops.recir.embedding_bag.default
_SEQ = torch.ops.recir.embedding.default
#: captured optimizer kind -> FBGEMM's fused optimizer (``EmbOptimType`` member); each also runs on
#: FBGEMM's CPU build. Adam/AdamW have a CUDA-only fused kernel: not wired (no CUDA here to check parity).
FUSED_OPTIMIZERS = {
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ADAGRAD",
    "sgd": "EXACT_SGD",
}
NONE_POOLING = 2  # FBGEMM's PoolingMode.NONE: one row per id (recir::embedding)


def _why_not_fused(kind: str | None, hp: dict[str, Any]) -> str | None:
    if kind not in FUSED_OPTIMIZERS:
        extra = (
            " (FBGEMM's fused Adam has no CPU kernel and is not wired here)"
            if kind in ("adam", "adamw")
            else ""
        )
        return (
            f"optimizer {kind!r} has no fused FBGEMM form here (fused: {', '.join(FUSED_OPTIMIZERS)}){extra}"
        )
    if hp.get("maximize"):
        return "maximize=True (FBGEMM's fused optimizers minimise)"
    if hp.get("weight_decay"):
        return f"weight_decay={hp['weight_decay']} (fused only without weight decay)"
    if kind == "adagrad" and hp.get("lr_decay"):
        return f"Adagrad lr_decay={hp['lr_decay']} (FBGEMM's Adagrad has no lr decay)"
    if kind == "sgd" and hp.get("momentum"):
        return "SGD with momentum (FBGEMM's fused SGD has none)"
    return None


def fused_tbe_tables(step: StepGraph) -> tuple[list[str], dict[str, str]]:
    """The tables of a step marked by ``SplitHostEmbeddings`` that FBGEMM's split TBE can train with its
    fused optimizer, and for each other table why not (``(fused, {slot: reason})``)."""
    info = step.meta.get(HOST_SPLIT_KEY)
    if info is None:
        raise ConfigError(
            "fused_tbe_tables: run SplitHostEmbeddings first (prepare_for_lowering(host_tables=True))"
        )
    reasons: dict[str, str] = dict(info["skipped"])
    optim = optimizer_infos(step)
    by_name = {n.name: n for n in step.graph.nodes}
    names = step.signature.state_names()
    per_table: dict[str, list[fx.Node]] = {}
    for name, table in zip(info["lookups"], info["lookup_tables"]):
        per_table.setdefault(table, []).append(by_name[name])
    fused = []
    for table in info["tables"]:
        spec = optim.get(table)
        why = _why_not_fused(spec.kind if spec else None, dict(spec.hparams) if spec else {})
        dtype = step.signature.state[names.index(table)].dtype
        lookups = per_table.get(table, [])
        shapes = {_pooling(n) for n in lookups}
        bags = {n.args[2].meta["val"].shape[0] for n in lookups if n.target == _BAG}
        if why is None and dtype != torch.float32:
            why = f"the table is {dtype} (fused here for float32 tables)"
        dim = step.signature.state[names.index(table)].shape[-1]
        if why is None and dim % 4:
            why = f"its embedding dim {dim} is not a multiple of 4 (FBGEMM's TBE needs one)"
        if why is None and len(shapes) > 1:
            why = "its lookups mix pooling modes (one FBGEMM TBE pools one way)"
        if why is None and len(bags) > 1:
            why = f"its pooled lookups have different batch sizes {sorted(bags)}"
        if why is None and (missing := [n.name for n in lookups if n.name not in info["lookup_grads"]]):
            why = f"lookup %{missing[0]}'s gradient reaches the update per id, not per pooled row"
        if why is None:
            fused.append(table)
        else:
            reasons[table] = why
    return fused, reasons


class _DropTBEConstructionLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("[TBE=")


@contextlib.contextmanager
def _quiet_tbe_construction() -> Iterator[None]:
    """FBGEMM logs ~10 INFO lines (its arguments, feature gates) on the root logger per TBE it builds:
    drop them while RecIR builds its TBEs (the one line RecIR logs says what was built)."""
    drop = _DropTBEConstructionLogs()
    root = logging.getLogger()
    handlers = list(root.handlers)
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


def _pooling(node: fx.Node) -> int:
    return NONE_POOLING if node.target == _SEQ else int(node.args[4])


@dataclasses.dataclass
class _Group:
    """One FBGEMM TBE: tables sharing optimizer, learning rate and pooling; features ordered by table."""

    tbe: Any
    tables: list[str]
    features: list[int]  # lookup indices, grouped by table (FBGEMM's CPU kernel wants them contiguous)
    pooling: int
    lr_slot: str
    weighted: bool
    dims: list[int]  # per feature


class FusedTBE:
    """FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` training a split step's tables (``split.tables``).

    Tables with the same optimizer, hyper-parameters, learning-rate slot and pooling share one TBE (one
    kernel call per group and step); a table's lookups are that TBE's features. ``device``: ``cpu`` (FBGEMM's
    CPU kernels, tables in host memory) or a CUDA device (tables in its memory). Call order each step:
    ``lookup`` (forward, given the step's learning rates; keeps the autograd graph), then ``backward`` with
    the device part's row gradients; between the two, the tables are unchanged.
    """

    def __init__(self, split: HostSplit, device: torch.device | str = "cpu") -> None:
        _fbgemm()  # ImportError naming the extra, or the versions of a FBGEMM built for another torch
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        self.split = split
        self.device = torch.device(device)
        step = split.step
        names = step.signature.state_names()
        optim = optimizer_infos(step)
        lookup_out = list(split.lookup.graph.output_node().args[0])[len(split.host_slots) :]
        self._modes = [_pooling(n) for n in lookup_out]
        self._args = _args_module(split.lookup, lookup_out)
        keys: dict[tuple[Any, ...], list[str]] = {}
        for table in split.tables:
            spec = optim[table]
            feats = [k for k, t in enumerate(split.lookup_tables) if t == table]
            if not feats or any(split.lookup_grads[k] is None for k in feats):
                raise ConfigError(
                    f"FusedTBE: table {table} has no lookup with a row gradient; see fused_tbe_tables"
                )
            pooled = self._modes[feats[0]]
            dim = step.signature.state[names.index(table)].shape[1]
            hp = tuple(sorted((k, repr(v)) for k, v in spec.hparams.items()))
            # pooled features of one TBE share the batch size; unpooled ones (one bag each) the row width
            first = lookup_out[feats[0]]
            shape = dim if pooled == NONE_POOLING else first.args[2].meta["val"].shape[0]
            key = (spec.kind, hp, spec.lr_slot, pooled, shape)
            keys.setdefault(key, []).append(table)
        on_cuda = self.device.type == "cuda"
        where = (
            (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
            if on_cuda
            else (EmbeddingLocation.HOST, ComputeDevice.CPU)
        )
        self.groups: list[_Group] = []
        for (kind, _, lr_slot, pooled, _), tables in keys.items():
            hparams = optim[tables[0]].hparams
            shapes = [step.signature.state[names.index(t)].shape for t in tables]
            features = [k for t in tables for k, lt in enumerate(split.lookup_tables) if lt == t]
            with _quiet_tbe_construction():
                tbe = SplitTableBatchedEmbeddingBagsCodegen(
                    [(int(s[0]), int(s[1]), *where) for s in shapes],
                    feature_table_map=[tables.index(split.lookup_tables[k]) for k in features],
                    optimizer=getattr(EmbOptimType, FUSED_OPTIMIZERS[kind]),
                    pooling_mode=PoolingMode(pooled),
                    learning_rate=float(hparams.get("lr", 0.01)),
                    eps=float(hparams.get("eps", 1e-8)),
                    weights_precision=SparseType.FP32,
                    output_dtype=SparseType.FP32,
                    device=self.device if on_cuda else None,
                )
            weighted = any(self._args.weighted[k] for k in features)
            dims = [int(shapes[tables.index(split.lookup_tables[k])][1]) for k in features]
            self.groups.append(_Group(tbe, tables, features, pooled, lr_slot, weighted, dims))
        # host slot name -> its tensor inside a TBE (a view: TBE updates it in place)
        self._views: dict[str, Tensor] = {}
        for grp in self.groups:
            weights = grp.tbe.split_embedding_weights()
            states = grp.tbe.split_optimizer_states()
            for t, table in enumerate(grp.tables):
                self._views[table] = weights[t]
                slots = split.tables[table][1:]
                for slot, buf in zip(slots, states[t] if states else []):
                    self._views[slot] = buf
                if len(slots) != (len(states[t]) if states else 0):
                    raise ConfigError(
                        f"FusedTBE: table {table} has optimizer state {slots} but FBGEMM keeps "
                        f"{len(states[t]) if states else 0} buffer(s) for it"
                    )
        self._host_names = [names[i] for i in split.host_slots]
        self._lr_seen: dict[int, tuple[int, int]] = {}
        self._pending: list[Tensor] | None = None
        log.info(
            "recir.embedding: FBGEMM TBE with fused backward + optimizer on %s: %s",
            self.device,
            "; ".join(f"{FUSED_OPTIMIZERS[optim[g.tables[0]].kind]} over {g.tables}" for g in self.groups),
        )

    def views(self) -> list[Tensor]:
        """The host slots (``split.host_slots`` order) as views of TBE's buffers."""
        return [self._views[name] for name in self._host_names]

    def load(self, host_state: Sequence[Tensor]) -> list[Tensor]:
        """Copy ``host_state`` (``split.host_slots`` order) into TBE's buffers; returns :meth:`views`.
        A tensor that already is the view is left alone."""
        views = self.views()
        if len(host_state) != len(views):
            raise ConfigError(f"FusedTBE: expected {len(views)} host state tensors, got {len(host_state)}")
        with torch.no_grad():
            for name, view, value in zip(self._host_names, views, host_state):
                if value.data_ptr() == view.data_ptr():
                    continue
                if tuple(value.shape) != tuple(view.shape):
                    raise ConfigError(
                        f"state {name!r}: expected shape {list(view.shape)}, got {list(value.shape)}. Fix: build "
                        "state with compiled.init_state(...) or compiled.load_state_dict(...)."
                    )
                view.copy_(value)
        return views

    def lookup(
        self, host_state: Sequence[Tensor], flat_batch: Sequence[Tensor], learning_rates: Sequence[Tensor]
    ) -> list[Tensor]:
        """Each lookup's rows (detached), looked up by the TBEs; keeps their outputs for :meth:`backward`.
        ``learning_rates``: each group's (``lr_slots``) for this step's update (TBE reads it at forward)."""
        if len(learning_rates) != len(self.groups):
            raise ConfigError(f"FusedTBE.lookup: {len(self.groups)} learning rate(s) expected (lr_slots)")
        values = self._args(host_state, flat_batch)
        rows: list[Tensor | None] = [None] * len(self._modes)
        outputs = []
        for grp, lr in zip(self.groups, learning_rates):
            self._set_lr(grp, lr)
            indices, offsets, weights, counts = _tbe_inputs(grp, self._args.layout, values, self.device)
            with torch.enable_grad():
                out = grp.tbe(indices, offsets, weights)
            outputs.append(out)
            for k, piece in zip(grp.features, _split_rows(grp, out, counts)):
                rows[k] = piece.detach().contiguous()
        self._pending = outputs
        missing = [k for k, r in enumerate(rows) if r is None]
        if missing:  # every lookup of the split belongs to a group by construction
            raise ConfigError(f"FusedTBE: lookup(s) {missing} of the split have no TBE (a RecIR bug)")
        return [r for r in rows if r is not None]

    def backward(self, row_grads: Sequence[Tensor]) -> None:
        """Apply each group's fused backward + optimizer, given the gradient w.r.t. every lookup's rows
        (``split.lookup_grads`` indexes ``row_grads``)."""
        if self._pending is None:
            raise ConfigError("FusedTBE.backward without a lookup: call lookup(...) first, once per step")
        outputs, self._pending = self._pending, None
        for grp, out in zip(self.groups, outputs):
            grads = [row_grads[self.split.lookup_grads[k]] for k in grp.features]  # type: ignore[index]
            grads = [g.to(out.device, out.dtype) for g in grads]
            grad = torch.cat(grads, dim=0 if grp.pooling == NONE_POOLING else 1)
            out.backward(grad.reshape(out.shape))

    @property
    def lr_slots(self) -> list[str]:
        """Each group's learning-rate state slot (the step's ``optim:group<i>:lr``)."""
        return [g.lr_slot for g in self.groups]

    def _set_lr(self, grp: _Group, lr: Tensor) -> None:
        key = (lr.data_ptr(), lr._version)
        if self._lr_seen.get(id(grp)) != key:  # a scheduler swaps in a new tensor: read it only then
            grp.tbe.set_learning_rate(float(lr))
            self._lr_seen[id(grp)] = key

    def __repr__(self) -> str:
        return f"FusedTBE({len(self.groups)} TBE(s) over {list(self.split.tables)} on {self.device})"


class _Args:
    """The lookups' inputs computed from the batch: a copy of the lookup part returning ids/offsets/weights."""

    def __init__(self, gm: fx.GraphModule, layout: list[tuple[int, int, int]], weighted: list[bool]) -> None:
        self.gm = gm
        self.layout = layout  # per lookup: (ids index, offsets index or -1, weights index or -1)
        self.weighted = weighted

    def __call__(self, host_state: Sequence[Tensor], flat_batch: Sequence[Tensor]) -> list[Tensor]:
        with torch.no_grad():
            return list(self.gm(*host_state, *flat_batch))


def _args_module(lookup: StepGraph, lookups: list[fx.Node]) -> _Args:
    gm = fx.GraphModule(lookup.graph_module, copy.deepcopy(lookup.graph))
    nodes = {n.name: n for n in gm.graph.nodes}
    outs: list[fx.Node] = []
    layout, weighted = [], []

    def add(node: Any) -> int:
        if not isinstance(node, fx.Node):
            return -1
        outs.append(node)
        return len(outs) - 1

    for n in lookups:
        node = nodes[n.name]
        if node.target == _SEQ:
            layout.append((add(node.args[1]), -1, -1))
            weighted.append(False)
        elif node.target == _BAG:
            layout.append((add(node.args[1]), add(node.args[2]), add(node.args[3])))
            weighted.append(isinstance(node.args[3], fx.Node))
        else:
            raise ConfigError(f"FusedTBE: lookup %{n.name} is {node.target}, not recir::embedding(_bag)")
    output = gm.graph.output_node()
    output.args = (tuple(outs),)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return _Args(gm, layout, weighted)


def _tbe_inputs(
    grp: _Group, layout: list[tuple[int, int, int]], values: list[Tensor], device: torch.device
) -> tuple[Tensor, Tensor, Tensor | None, list[int]]:
    """One TBE call's ``(indices, offsets, per_sample_weights)`` for the group's features, concatenated
    feature by feature, and each feature's id count. A bag's ids past its last offset (a jagged batch's
    padding) are dropped, so the next feature's bags start where its ids do."""
    ids, bounds, weights, counts = [], [torch.zeros(1, dtype=torch.int64)], [], []
    base = 0
    for k in grp.features:
        i_ids, i_off, i_w = layout[k]
        f_ids = values[i_ids].to(torch.int64)
        f_w = values[i_w] if i_w >= 0 else None
        if i_off < 0:  # a sequence lookup: the feature is one bag of all its ids (pooling NONE)
            f_off = torch.tensor([0, f_ids.shape[0]], dtype=torch.int64)
        else:
            f_off = values[i_off].to(device="cpu", dtype=torch.int64)
            first, last = int(f_off[0]), int(f_off[-1])
            if (first, last) != (0, f_ids.shape[0]):
                f_ids, f_off = f_ids[first:last], f_off - first
                f_w = f_w[first:last] if f_w is not None else None
        ids.append(f_ids)
        counts.append(int(f_ids.shape[0]))
        bounds.append(f_off[1:] + base)
        base += counts[-1]
        if grp.weighted:
            weights.append(f_w.float() if f_w is not None else torch.ones(counts[-1], device=f_ids.device))
    return (
        torch.cat(ids).to(device),
        torch.cat(bounds).to(device),
        torch.cat(weights).to(device) if grp.weighted else None,
        counts,
    )


def _split_rows(grp: _Group, out: Tensor, counts: list[int]) -> list[Tensor]:
    """A TBE output cut into its features' rows: ``[ids, D]`` pieces (pooling NONE) or ``[B, D_k]`` columns."""
    if grp.pooling == NONE_POOLING:
        return list(out.split(counts, dim=0))
    return list(out.split(grp.dims, dim=1))
