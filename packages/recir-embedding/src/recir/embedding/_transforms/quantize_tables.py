"""recir-embed-quantize-tables: a serving graph's embedding tables stored row-wise quantised (int8 or fp16).

Each lookup gathers quantised rows, dequantises only those and pools them as before, so the graph's
table inputs shrink 4x (int8, plus 8 bytes of scale and bias per row) or 2x (fp16), in plain ATen
(``kernel="aten"``), or are stored in FBGEMM's inference-TBE rows and read by ``recir::quantized_lookup``
(``kernel="fbgemm"``: FBGEMM's kernel in the GPU path's exported package, its ATen reference elsewhere).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.fx as fx
from recir.transforms import (
    INFERENCE_KEY,
    PHASE_KEY,
    ConfigError,
    Region,
    RegionTransform,
    StateSlot,
    StepGraph,
    TransformResult,
    embedding_bag_reference,
    param_buffer_initializer,
    register_transform,
)
from torch import Tensor, nn

from .._quantized_lookup import (
    POOL_NONE,
    QTYPES,
    pack_rows,
    packed_row_bytes,
    quantized_lookup,
    unpack_rows,
)
from .sparsify_update import embedding_tables

aten = torch.ops.aten
#: ``step.meta`` key: what recir-embed-quantize-tables did, as plain data (the exports' manifests copy it).
QUANTIZE_KEY = "recir.quantize"
QUANT_DTYPES: tuple[str, ...] = ("int8", "fp16")
#: how quantised rows are stored and read: recir's own parts in plain ATen, or FBGEMM's inference-TBE rows
QUANT_KERNELS: tuple[str, ...] = ("aten", "fbgemm")
# FBGEMM's row-wise 8-bit quantisation (FloatToFused8BitRowwiseQuantized): scale = range / 255,
# bias = the row's minimum, q = round-half-even((x - min) * 255 / (range + 1e-8)) stored as uint8
_FBGEMM_EPS = 1e-8
_SAME = {aten.detach.default, aten.alias.default}
# lookup op -> how the rewrite reads it: "gather" (one row per id) or "bag" (pooled per bag)
_LOOKUPS: dict[Any, str] = {
    torch.ops.recir.embedding.default: "gather",
    aten.embedding.default: "gather",
    torch.ops.recir.embedding_bag.default: "bag",
    aten._embedding_bag.default: "bag",
    aten._embedding_bag_forward_only.default: "bag",
}


def quantize_rows(weight: Tensor, dtype: str) -> tuple[Tensor, ...]:
    """``weight`` ([rows, D], floating) quantised row-wise: ``(q uint8, scale f32 [rows], bias f32
    [rows])`` for ``"int8"`` (FBGEMM's 8-bit row-wise scheme, ``row ~ q * scale + bias``), ``(half,)``
    for ``"fp16"``."""
    if dtype not in QUANT_DTYPES:
        raise ConfigError(f"quantize_rows: dtype must be one of {QUANT_DTYPES}, got {dtype!r}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ConfigError(
            f"quantize_rows: expected a floating [rows, D] table, got {weight.dtype}{list(weight.shape)}"
        )
    w = weight.detach().float()
    if dtype == "fp16":
        return (w.half(),)
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    span = hi - lo
    q = torch.round((w - lo[:, None]) * (255.0 / (span + _FBGEMM_EPS))[:, None]).clamp(0, 255)
    return q.to(torch.uint8), span / 255.0, lo


def dequantize_rows(parts: Sequence[Tensor], ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The rows ``ids`` (1-D) of a table quantised by :func:`quantize_rows`, as ``dtype`` ([len(ids), D])."""
    rows = parts[0].index_select(0, ids).to(torch.float32)
    if len(parts) == 3:
        rows = rows * parts[1].index_select(0, ids).unsqueeze(1) + parts[2].index_select(0, ids).unsqueeze(1)
    return rows.to(dtype)


def _part_names(table: str, dtype: str, kernel: str = "aten") -> list[str]:
    if kernel == "fbgemm":
        return [f"{table}_fbgemm_{dtype}"]
    return [f"{table}_int8", f"{table}_qscale", f"{table}_qbias"] if dtype == "int8" else [f"{table}_fp16"]


def _part_slots(slot: StateSlot, dtype: str, kernel: str = "aten") -> list[StateSlot]:
    rows = slot.shape[0]
    if kernel == "fbgemm":
        shape = (rows, packed_row_bytes(slot.shape[1], dtype))
        return [StateSlot(_part_names(slot.name, dtype, kernel)[0], "param", shape, torch.uint8)]
    if dtype == "fp16":
        return [StateSlot(_part_names(slot.name, dtype)[0], "param", slot.shape, torch.float16)]
    shapes = [(slot.shape, torch.uint8), ((rows,), torch.float32), ((rows,), torch.float32)]
    return [StateSlot(n, "param", s, d) for n, (s, d) in zip(_part_names(slot.name, dtype), shapes)]


@dataclasses.dataclass(frozen=True)
class QuantizedTableInitializer:
    """A SlotInitializer for the slots of quantised tables: quantises the live model's table.

    ``parts`` maps each new slot name to ``(table slot, dtype, part index)``; ``kernel="fbgemm"``: the one
    part is the table packed in FBGEMM's inference-TBE rows (``pack_rows``).
    """

    parts: dict[str, tuple[StateSlot, str, int]]
    kernel: str = "aten"

    def __call__(self, slot: StateSlot, model: nn.Module, optimizer: Any) -> Tensor | None:
        entry = self.parts.get(slot.name)
        if entry is None:
            return None
        table, dtype, index = entry
        weight = param_buffer_initializer(table, model, optimizer)
        if weight is None:  # pragma: no cover - param_buffer_initializer knows every param: slot
            return None
        if self.kernel == "fbgemm":
            return pack_rows(weight, dtype)
        return quantize_rows(weight, dtype)[index]


@register_transform
class QuantizeTables(RegionTransform):
    """Store an inference graph's embedding tables row-wise quantised; lookups dequantise gathered rows.

    Runs on a serving graph (``recir.transforms.to_inference``). Tables are the parameters a lookup reads
    as its weight (recir-embed-sparsify-update's ``embedding_tables``: ``recir::embedding(_bag)``, ``nn.Embedding``,
    ``nn.EmbeddingBag``; DLRMv3's position and time embeddings are dense parameters, left alone). Each
    table's state slot becomes ``<slot>_int8`` (uint8 [R, D]), ``<slot>_qscale`` and ``<slot>_qbias``
    (float32 [R], FBGEMM's 8-bit row-wise scheme) or ``<slot>_fp16``; ``step.init_state(model)``
    quantises the live table (:class:`QuantizedTableInitializer`). Before -> after (int8)::

        %W:  f32[R, D] (param:emb.weight)
        %e = aten._embedding_bag(%W, %ids, %offsets)
        %pooled = getitem(%e, 0)
        ->
        %Wq: u8[R, D] (param:emb.weight_int8), %s: f32[R] (..._qscale), %b: f32[R] (..._qbias)
        %rows = add(mul(_to_copy(index_select(%Wq, 0, %ids), f32), unsqueeze(index_select(%s, 0, %ids), 1)),
                    unsqueeze(index_select(%b, 0, %ids), 1))
        %e2 = aten._embedding_bag(%rows, arange(N), %offsets)   # the same pooling over the gathered rows
        %pooled = getitem(%e2, 0)

    ``tables``: only these table slots (default: every table). A table also read by something other than
    a lookup (a tied output projection), or an ``nn.EmbeddingBag`` with ``padding_idx``, stays as it is
    (``stats["skipped"]`` says why). ``step.meta["recir.quantize"]`` records the dtype, kernel and slots.

    ``kernel="fbgemm"``: each table is one slot ``<slot>_fbgemm_<dtype>``, uint8 rows in FBGEMM's
    inference-TBE layout (``pack_rows``), and each lookup one ``recir::quantized_lookup`` (pooling sum,
    mean or none; a max-pooled bag unpacks the gathered rows and pools as before). recir-lower-gpu's
    export calls FBGEMM's kernel for it, every other lowering inlines its ATen reference.
    """

    name = "recir-embed-quantize-tables"
    summary = "store the serving graph's embedding tables row-wise quantised (int8 + scale/bias, or fp16)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        dtype: Literal["int8", "fp16"] = "int8"
        tables: tuple[str, ...] | None = None
        kernel: Literal["aten", "fbgemm"] = "aten"

        def __post_init__(self) -> None:
            if self.dtype not in QUANT_DTYPES:
                raise ConfigError(
                    f"recir-embed-quantize-tables: dtype must be one of {QUANT_DTYPES}, got {self.dtype!r}"
                )
            if self.kernel not in QUANT_KERNELS:
                raise ConfigError(
                    f"recir-embed-quantize-tables: kernel must be one of {QUANT_KERNELS}, got {self.kernel!r}"
                )

    def requires(self, step: StepGraph) -> None:
        training = sorted({n.meta.get(PHASE_KEY) for n in step.graph.nodes} & {"backward", "optimizer"})
        if INFERENCE_KEY not in step.meta or training:
            raise ConfigError(
                f"{self.name}: the step is a training step (phases {training or ['forward']}, no "
                f"meta[{INFERENCE_KEY!r}]); quantised tables cannot be trained. Fix: quantise the serving "
                "graph, recir.transforms.to_inference(step, output) first."
            )

    # -- match ------------------------------------------------------------------------------------
    def match(self, step: StepGraph) -> list[Region]:
        sig = step.signature
        placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
        self._placeholder = {s.name: placeholders[i] for i, s in enumerate(sig.state)}
        tables = [t for t in embedding_tables(step) if sig.state[sig.state_index(t)].dtype.is_floating_point]
        wanted = tables if self.options.tables is None else list(self.options.tables)
        unknown = [t for t in wanted if t not in tables]
        if unknown:
            raise ConfigError(
                f"{self.name}: {unknown} are not embedding tables of this step; its tables are {tables}. "
                "Fix: pass tables=(...) from that list, or leave it unset for all of them."
            )
        self.skipped: dict[str, str] = {}
        self._table_of: dict[fx.Node, str] = {}
        regions = []
        for table in wanted:
            lookups, reason = self._lookups(self._placeholder[table])
            if reason:
                self.skipped[table] = reason
                continue
            for node in lookups:
                self._table_of[node] = table
                getitems = [u for u in node.users if u.target is operator.getitem]
                regions.append(Region(step, [node, *getitems], f"{table}:{node.name}"))
        self._parts: dict[str, list[fx.Node]] = {}
        return regions

    def _lookups(self, placeholder: fx.Node) -> tuple[list[fx.Node], str]:
        """The lookups reading ``placeholder`` as their table (through detach/alias), or why it stays."""
        lookups, todo = [], [placeholder]
        while todo:
            value = todo.pop()
            for user in value.users:
                if user.op == "output":
                    continue
                if user.target in _SAME:
                    todo.append(user)
                elif user.target in _LOOKUPS and user.args[0] is value and value not in user.args[1:]:
                    padding = user.args[8] if len(user.args) > 8 else user.kwargs.get("padding_idx")
                    if _LOOKUPS[user.target] == "bag" and padding not in (None, -1):
                        return [], f"%{user.name} pools with padding_idx={padding}"
                    lookups.append(user)
                else:
                    return [], f"%{user.name} ({user.target}) reads the table, not a lookup"
        return lookups, ""

    # -- rewrite ----------------------------------------------------------------------------------
    def rewrite(self, step: StepGraph, region: Region) -> bool:
        node = region.nodes[0]
        table = self._table_of[node]
        parts = self._parts.get(table) or self._add_parts(step, table)
        kind = _LOOKUPS[node.target]
        exits = [g.args[1] if g is not node else None for g in region.outputs]
        n_in = len(region.inputs)
        target = node.target
        args, kwargs = node.args, node.kwargs
        inputs = list(region.inputs)

        dtype, kernel = self.options.dtype, self.options.kernel

        def swapped(*vals: Tensor) -> list[Tensor]:
            env = dict(zip(inputs, vals[:n_in]))
            a = fx.node.map_arg(args, env.__getitem__)
            kw = fx.node.map_arg(kwargs, env.__getitem__)
            table_val, ids = a[0], a[1]
            if kernel == "fbgemm":
                looked_up = _packed_lookup(target, kind, a, kw, exits, vals[n_in], dtype)
                if looked_up is not None:
                    return [looked_up.to(table_val.dtype)]
            flat = ids.reshape(-1)
            if kernel == "fbgemm":
                # a pooling FBGEMM has not (max), or outputs beyond the pooled rows: unpack, pool as before
                unpacked = unpack_rows(vals[n_in].index_select(0, flat), table_val.shape[1], dtype)
                rows = unpacked.to(table_val.dtype)
            else:
                rows = dequantize_rows(vals[n_in:], flat, table_val.dtype)
            if kind == "gather":
                return [rows.reshape(*ids.shape, rows.shape[-1])]
            positions = torch.arange(flat.shape[0], device=flat.device, dtype=flat.dtype).reshape(ids.shape)
            if target is torch.ops.recir.embedding_bag.default:
                return [embedding_bag_reference(rows, positions, *a[2:])]
            out = target(rows, positions, *a[2:], **kw)
            return [out[i] for i in exits]

        new = region.replace(swapped, provenance=self.name, extra_inputs=parts)
        for n in reversed(
            new.nodes
        ):  # the pooled op's unread outputs (offset2bag, ...): make_fx made getitems
            if n.target is operator.getitem and not n.users:
                step.graph.erase_node(n)
        return True

    def _add_parts(self, step: StepGraph, table: str) -> list[fx.Node]:
        """New state slots (placeholders, outputs, signature entries) right after ``table``'s slot."""
        sig = step.signature
        index = sig.state_index(table)
        old = self._placeholder[table]
        slots = _part_slots(sig.state[index], self.options.dtype, self.options.kernel)
        from torch._guards import detect_fake_mode

        fake_mode = detect_fake_mode([old.meta["val"]])
        nodes, at = [], old
        for slot in slots:
            with step.graph.inserting_after(at):
                ph = step.graph.placeholder(slot.name.replace(":", "_").replace(".", "_"))
            with fake_mode or torch._subclasses.fake_tensor.FakeTensorMode():
                ph.meta = {
                    **old.meta,
                    "val": torch.empty(slot.shape, dtype=slot.dtype, device=old.meta["val"].device),
                }
            nodes.append(ph)
            at = ph
        output = step.graph.output_node()
        outs = list(output.args[0])
        output.args = (tuple(outs[: index + 1] + nodes + outs[index + 1 :]),)
        state = list(sig.state)
        step.signature = dataclasses.replace(
            sig, state=tuple(state[: index + 1] + slots + state[index + 1 :])
        )
        self._parts[table] = nodes
        return nodes

    def run(self, step: StepGraph) -> TransformResult:
        step = step.copy()  # the caller keeps its float serving graph (e.g. to measure the accuracy delta)
        result = super().run(step)
        dtype, kernel = self.options.dtype, self.options.kernel
        sig = step.signature
        quantized = {t: sig.state[sig.state_index(t)] for t in self._parts}
        for table in quantized:  # the float table: now read by nothing but its pass-through output
            _drop_state_slot(step, table)
        if quantized:
            parts = {
                name: (slot, dtype, i)
                for table, slot in quantized.items()
                for i, name in enumerate(_part_names(table, dtype, kernel))
            }
            step.initializers = (QuantizedTableInitializer(parts, kernel), *step.initializers)
            step.meta[QUANTIZE_KEY] = {
                "dtype": dtype,
                "kernel": kernel,
                "scheme": _SCHEMES[kernel, dtype],
                "tables": {t: _part_names(t, dtype, kernel) for t in quantized},
                "skipped": dict(self.skipped),
            }
        step.graph_module.recompile()
        before = sum(_nbytes(s) for s in quantized.values())
        after = sum(_nbytes(s) for s in _slots_of(step, quantized, dtype, kernel))
        stats = {**result.stats, "tables": len(quantized), "skipped": dict(self.skipped)}
        return TransformResult(
            step, result.changed, {**stats, "table_bytes": before, "quantized_bytes": after}
        )


def _packed_lookup(
    target: Any, kind: str, a: Sequence[Any], kw: dict[str, Any], exits: list[Any], packed: Tensor, dtype: str
) -> Tensor | None:
    """The lookup ``target(*a, **kw)`` as one ``recir::quantized_lookup`` of the packed table (float32),
    or None when FBGEMM's kernel has no such lookup (max pooling, or its other outputs are read)."""
    ids, dim, qtype = a[1], a[0].shape[1], QTYPES[dtype]
    flat = ids.reshape(-1)
    if kind == "gather":
        offsets = torch.arange(flat.shape[0] + 1, dtype=torch.int64, device=flat.device)
        rows: Tensor = quantized_lookup(packed, flat, offsets, None, POOL_NONE, dim, qtype)
        return rows.reshape(*ids.shape, dim)
    if target is torch.ops.recir.embedding_bag.default:
        _, _, offsets, psw, mode = a
        pooled: Tensor = quantized_lookup(packed, flat, offsets, psw, mode, dim, qtype)
        return pooled
    names = (
        "scale_grad_by_freq",
        "mode",
        "sparse",
        "per_sample_weights",
        "include_last_offset",
        "padding_idx",
    )
    defaults = (False, 0, False, None, False, -1)
    opts = {
        n: (a[3 + i] if len(a) > 3 + i else kw.get(n, d)) for i, (n, d) in enumerate(zip(names, defaults))
    }
    if opts["mode"] not in (0, 1) or exits != [0]:
        return None
    offsets = a[2]
    if not opts["include_last_offset"]:
        offsets = torch.cat([offsets, offsets.new_full((1,), flat.shape[0])])
    pooled = quantized_lookup(packed, flat, offsets, opts["per_sample_weights"], opts["mode"], dim, qtype)
    return pooled


_SCHEMES = {
    ("aten", "int8"): "row-wise: uint8 * qscale + qbias (FBGEMM 8-bit)",
    ("aten", "fp16"): "fp16 rows",
    ("fbgemm", "int8"): "FBGEMM inference-TBE rows: [scale fp16, bias fp16, uint8 x D], 16-byte aligned",
    ("fbgemm", "fp16"): "FBGEMM inference-TBE rows: [fp16 x D], 16-byte aligned",
}


def _nbytes(slot: StateSlot) -> int:
    numel = 1
    for d in slot.shape:
        numel *= d
    return numel * slot.dtype.itemsize


def _slots_of(step: StepGraph, tables: dict[str, StateSlot], dtype: str, kernel: str) -> list[StateSlot]:
    sig = step.signature
    return [sig.state[sig.state_index(n)] for t in tables for n in _part_names(t, dtype, kernel)]


def _drop_state_slot(step: StepGraph, name: str) -> None:
    sig = step.signature
    index = sig.state_index(name)
    placeholder = [n for n in step.graph.nodes if n.op == "placeholder"][index]
    output = step.graph.output_node()
    output.args = (tuple(a for i, a in enumerate(output.args[0]) if i != index),)
    for node in reversed(list(step.graph.nodes)):  # the detach/alias chains the lookups read through
        if node.op == "call_function" and node.target in _SAME and not node.users:
            step.graph.erase_node(node)
    step.graph.erase_node(placeholder)
    step.signature = dataclasses.replace(sig, state=tuple(s for i, s in enumerate(sig.state) if i != index))
