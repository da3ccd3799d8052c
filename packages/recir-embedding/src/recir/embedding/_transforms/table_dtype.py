"""recir-embed-table-dtype: a training step's embedding tables stored in fp16 or bf16, updated in float32.

Each table's state slot takes the low-precision dtype (half the bytes of float32), and every computation
reading it is float32 as before:
- a lookup gathers the stored rows and widens only those (a pooled bag pools the widened rows);
- the gradient and the optimizer update read a float32 copy of the table (the dense form), and the new
  table is rounded back stochastically (:func:`recir.embedding.round_stochastic`, FBGEMM's rounding of
  fp16 tables) and written as the old table plus a delta in its dtype, as the row-wise form's scatter
  writes it (``low_precision_delta``);
- recir-embed-sparsify-update, run by both lowerings afterwards, makes the update row-wise: the touched
  rows are gathered, widened, updated, rounded and written back, and the whole-table copy disappears.

The optimizer state (the row-wise Adagrad accumulator, Adam's moments) stays float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
import torch.fx as fx
from recir.transforms import (
    OPTIM_PARAM_KEY,
    OPTIMIZER_KEY,
    PHASE_KEY,
    SCOPE_KEY,
    ConfigError,
    StateSlot,
    StepGraph,
    Transform,
    TransformResult,
    embedding_bag_reference,
    optimizer_infos,
    parse_slot_name,
    register_transform,
    splice,
)
from torch import Tensor, nn

from .._rowwise import element_index, low_precision_delta
from .sparsify_update import TABLE_ELEMENTS_KEY, embedding_tables

aten = torch.ops.aten
#: ``--table_dtype`` names -> torch dtypes
TABLE_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: ``step.meta`` key: the tables recir-embed-table-dtype stores in low precision, ``{slot: "fp16"|"bf16"}``
TABLE_DTYPE_KEY = "recir.table_dtype"
_GATHERS = {torch.ops.recir.embedding.default, aten.embedding.default}
_BAGS = {torch.ops.recir.embedding_bag.default}
_SAME = {aten.detach.default, aten.alias.default}


@dataclasses.dataclass(frozen=True)
class TableDtypeInitializer:
    """A SlotInitializer for tables stored in low precision: the live model's table, rounded to nearest."""

    dtypes: tuple[tuple[str, str], ...]  # (slot name, "fp16" | "bf16")
    # the step's initializers before the rewrite: a slot that is not the model's whole table (a rank's
    # shard, after recir.distributed.distribute) is resolved by them, then rounded
    rest: tuple[Any, ...] = ()

    def __call__(self, slot: StateSlot, model: nn.Module, optimizer: Any) -> Tensor | None:
        dtype = dict(self.dtypes).get(slot.name)
        path = parse_slot_name(slot.name).path
        if dtype is None or path is None:
            return None
        try:
            weight = model.get_parameter(path)
        except AttributeError:
            weight = None
        if weight is not None and tuple(weight.shape) == tuple(slot.shape):
            return weight.detach().to(TABLE_DTYPES[dtype])  # no float32 copy of the table on the way
        for init in self.rest:
            value = init(slot, model, optimizer)
            if value is not None:
                return value.to(TABLE_DTYPES[dtype])  # type: ignore[no-any-return]
        return None


@register_transform
class TableDtype(Transform):
    """Store a training step's embedding tables in fp16 or bf16; lookups widen gathered rows, updates are
    float32 and round stochastically.

    Tables are recir-embed-sparsify-update's (``embedding_tables``): parameters a lookup reads as its weight.
    Supported lookups: ``recir::embedding`` and ``aten.embedding`` (one row per id) and
    ``recir::embedding_bag`` (pooled). A table read otherwise, or without an optimizer update, stays
    float32 (``stats["skipped"]`` says why). Before -> after, in the captured (dense) form::

        %W: f32[R, D]                                  %W: f16[R, D]
        %e = recir.embedding(%W, %ids)                  %e16 = recir.embedding(%W, %ids); %e = %e16.float()
        %new = sub(%W, update(%grad, ...))      ->      %W32 = %W.float(); %new32 = sub(%W32, update(...))
                                                        %t = round_stochastic(%new32, f16, index)
                                                        %new = f16(%W + f16(%t - %W))  # the scatter's sum

    ``step.init_state(model)`` rounds the model's float32 table to nearest (``TableDtypeInitializer``);
    a float32 checkpoint loads into the slot the same way (``StepGraph.load_state_dict`` casts), and a
    low-precision one into a float32 run exactly. ``step.meta["recir.table_dtype"]`` lists the tables.
    """

    name = "recir-embed-table-dtype"
    summary = (
        "store embedding tables fp16/bf16: lookups widen gathered rows, fp32 updates rounded stochastically"
    )

    @dataclasses.dataclass(frozen=True)
    class Options:
        dtype: Literal["fp16", "bf16"] = "fp16"
        tables: tuple[str, ...] | None = None  # table slots to store (default: every table)
        # tables that are shards of larger ones (a rank's program after recir.distributed.distribute):
        # (slot, first row, first column, the whole table's width), so the stochastic rounding of each element
        # draws the bits it draws in the whole table (a one-process run's)
        elements: tuple[tuple[str, int, int, int], ...] = ()

        def __post_init__(self) -> None:
            if self.dtype not in TABLE_DTYPES:
                raise ConfigError(
                    f"recir-embed-table-dtype: dtype must be one of {tuple(TABLE_DTYPES)}, got {self.dtype!r}"
                )

    def requires(self, step: StepGraph) -> None:
        if OPTIMIZER_KEY not in step.meta:
            raise ConfigError(
                f"{self.name}: the step has no meta[{OPTIMIZER_KEY!r}] (it is no captured training step). "
                "Fix: capture it with recir.capture.capture_train_step; for a serving graph use "
                "recir.embedding.QuantizeTables(dtype='fp16')."
            )

    def run(self, step: StepGraph) -> TransformResult:
        dtype = TABLE_DTYPES[self.options.dtype]
        sig = step.signature
        names = sig.state_names()
        tables = [t for t in embedding_tables(step) if sig.state[names.index(t)].dtype == torch.float32]
        wanted = tables if self.options.tables is None else list(self.options.tables)
        unknown = [t for t in wanted if t not in tables]
        if unknown:
            raise ConfigError(
                f"{self.name}: {unknown} are not float32 embedding tables of this step; its tables are "
                f"{tables}. Fix: pass tables=(...) from that list, or leave it unset for all of them."
            )
        placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
        optimized = optimizer_infos(step)
        skipped: dict[str, str] = {}
        done: list[str] = []
        for table in wanted:
            index = names.index(table)
            element = next((tuple(e[1:]) for e in self.options.elements if e[0] == table), None)
            reason = self._store(step, placeholders[index], index, dtype, table in optimized, element)  # type: ignore[arg-type]
            if reason:
                skipped[table] = reason
            else:
                done.append(table)
        if done:
            state = [dataclasses.replace(s, dtype=dtype) if s.name in done else s for s in sig.state]
            step.signature = dataclasses.replace(sig, state=tuple(state))
            stored = tuple((t, self.options.dtype) for t in done)
            step.initializers = (TableDtypeInitializer(stored, tuple(step.initializers)), *step.initializers)
            step.meta[TABLE_DTYPE_KEY] = {**step.meta.get(TABLE_DTYPE_KEY, {}), **dict(stored)}
            elements = {e[0]: tuple(e[1:]) for e in self.options.elements if e[0] in done}
            if elements:
                step.meta[TABLE_ELEMENTS_KEY] = {**step.meta.get(TABLE_ELEMENTS_KEY, {}), **elements}
            step.graph.eliminate_dead_code()
            step.graph.lint()
            step.graph_module.recompile()
        saved = sum(sig.state[names.index(t)].shape[0] * sig.state[names.index(t)].shape[1] for t in done)
        stats = {"tables": done, "skipped": skipped, "bytes_saved": saved * (4 - dtype.itemsize)}
        return TransformResult(step, bool(done), stats)

    def _store(
        self,
        step: StepGraph,
        ph: fx.Node,
        index: int,
        dtype: torch.dtype,
        has_update: bool,
        element: tuple[int, int, int] | None = None,
    ) -> str:
        """Rewrite one table's reads and its new value; the reason it stays float32, or ""."""
        if not has_update:
            return "no optimizer updates it"
        output = step.graph.output_node()
        outs = list(output.args[0])
        chain, todo = [ph], [ph]  # the table and its detach/alias chains (each the same tensor)
        while todo:
            for user in todo.pop().users:
                if user.target in _SAME and user not in chain:
                    chain.append(user)
                    todo.append(user)
        if outs[index] in chain:
            return "its new value is the old one (no update in the graph)"
        lookups = [u for c in chain for u in c.users if u.target in _GATHERS | _BAGS and u.args[0] is c]
        if any(c in u.args[1:] for u in lookups for c in chain):
            return f"%{lookups[0].name} reads the table as another argument too"
        others = [
            (c, u) for c in chain for u in c.users if u not in chain and u not in lookups and u.op != "output"
        ]
        for _, user in others:
            if user.meta.get(PHASE_KEY) == "forward":
                return f"%{user.name} ({user.target}) reads it in the forward, not a supported lookup"
        for c in chain:
            old = c.meta["val"]
            with _fake_mode(old):
                c.meta["val"] = torch.empty(tuple(old.shape), dtype=dtype, device=old.device)
            c.meta.pop("tensor_meta", None)
        graph = step.graph
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for lookup in lookups:
            self._widen_lookup(graph, lookup.args[0], lookup)
        if others:  # the dense gradient and update: a float32 copy of the table (gone once row-wise)
            known = set(graph.nodes)
            (wide,) = splice(
                graph, lambda w: w.float(), [ph], before=first, phase="forward", provenance=self.name
            )
            _tag(graph, known, others[0][1].meta, (SCOPE_KEY,))
            for c, user in others:
                user.replace_input_with(c, wide)
        new = outs[index]
        known = set(graph.nodes)

        def rounded_table(new: Tensor, old: Tensor) -> Tensor:  # what the row-wise form's scatter leaves
            every_row = torch.arange(new.shape[0], device=new.device)
            delta = low_precision_delta(old, new, element_index(every_row, new.shape[1], element))
            return (old.float() + delta.float()).to(old.dtype)

        (rounded,) = splice(
            graph,
            rounded_table,
            [new, ph],
            before=output,
            phase="optimizer",
            provenance=self.name,
        )
        _tag(graph, known, new.meta, (SCOPE_KEY, OPTIM_PARAM_KEY))
        outs[index] = rounded
        output.args = (tuple(outs),)
        return ""

    def _widen_lookup(self, graph: fx.Graph, table: fx.Node, lookup: fx.Node) -> None:
        """``lookup`` reads the low-precision table: gathered rows widen to float32 (a bag pools them after)."""
        args, kwargs = lookup.args, lookup.kwargs
        inputs = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, fx.Node)]
        target = lookup.target

        def widened(table: Tensor, *vals: Tensor) -> Tensor:
            env = dict(zip(inputs, vals))
            a = fx.node.map_arg(args[1:], env.__getitem__)
            kw = fx.node.map_arg(kwargs, env.__getitem__)
            if target in _GATHERS:
                out: Tensor = target(table, *a, **kw)  # type: ignore[operator]
                return out.float()
            ids = a[0]
            flat = ids.reshape(-1)
            rows = table.index_select(0, flat).float()
            positions = torch.arange(flat.shape[0], device=flat.device, dtype=flat.dtype).reshape(ids.shape)
            return embedding_bag_reference(rows, positions, *a[1:], **kw)

        phase = lookup.meta.get(PHASE_KEY, "forward")
        known = set(graph.nodes)
        (new,) = splice(graph, widened, [table, *inputs], before=lookup, phase=phase, provenance=self.name)
        _tag(graph, known, lookup.meta, (SCOPE_KEY,))
        lookup.replace_all_uses_with(new)
        graph.erase_node(lookup)


def _tag(graph: fx.Graph, known: set[fx.Node], meta: dict[str, Any], keys: tuple[str, ...]) -> None:
    """The nodes of ``graph`` not in ``known`` (a splice's) take ``meta``'s ``keys`` (module scope, the
    optimized parameter), so profiles, regions and recompute see them where the nodes they replace were."""
    for node in graph.nodes:
        if node not in known:
            node.meta.update({k: meta[k] for k in keys if k in meta and k not in node.meta})


def _fake_mode(val: Tensor) -> Any:
    """The FakeTensorMode ``val`` belongs to (a new one for a value without)."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode([val]) or FakeTensorMode()
