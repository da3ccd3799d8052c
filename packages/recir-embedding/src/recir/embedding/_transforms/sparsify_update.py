"""recir-embed-sparsify-update: turn a table's dense gradient + optimizer update into row-wise updates.

The step then costs O(ids in the batch) instead of O(table rows) (given in-place state updates).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import (
    GRAD_OF_KEY,
    OPTIMIZER_KEY,
    PHASE_KEY,
    SCOPE_KEY,
    ConfigError,
    OptimizerInfo,
    StepGraph,
    Transform,
    TransformResult,
    bag_segment_ids,
    grad_nodes,
    optim_param,
    optimizer_infos,
    parse_slot_name,
    register_transform,
    splice,
)

from .._rowwise import LOW_PRECISION_BITS, SPARSE_KINDS, sparse_update

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default}
_ZEROS = {aten.new_zeros.default, aten.zeros.default, aten.zeros_like.default}
_INDEX_PUTS = {aten.index_put.default, aten._unsafe_index_put.default}
_SAME = {aten.detach.default, aten.clone.default, aten.alias.default}
#: ``step.meta`` key (recir-embed-table-dtype's ``elements``): ``{table slot: (first row, first column, width)}``
#: of a low-precision table that is a shard of a larger one, so its stochastic rounding draws the whole table's bits
TABLE_ELEMENTS_KEY = "recir.table_dtype.elements"
#: On each per-id gradient term a table's row update consumes (set by recir-embed-sparsify-update): a list
#: of ``(table slot, ids node name)``. recir-embed-split-host starts from it to find the gradient w.r.t.
#: each lookup's rows, the value a host-side table update receives from the device.
ROW_GRAD_KEY = "recir.row_grad_of"
_LOOKUPS = {
    aten.embedding.default,
    aten._embedding_bag.default,
    aten._embedding_bag_forward_only.default,
    aten.embedding_bag.default,
    aten.embedding_bag.padding_idx,
}


@dataclasses.dataclass(frozen=True)
class _Term:
    """One lookup's share of a table's gradient: the ids it read and where their gradient rows come from.

    ``grad`` holds the per-id gradient rows (``[*ids.shape, D]``), or, for an ``nn.EmbeddingBag``
    (``bag`` set: ``(mode, padding_idx, has_per_sample_weights)``), the pooled gradient ``[B, D]``, from
    which :func:`_per_id_grads` spreads each bag's row back over its ids (``offsets`` and
    ``per_sample_weights`` are then the lookup's).
    """

    ids: fx.Node
    grad: fx.Node
    offsets: fx.Node | None = None
    per_sample_weights: fx.Node | None = None
    bag: tuple[int, int, bool] | None = None
    aten_lookup: bool = False  # from a plain ATen lookup's gradient (index_put / _embedding_bag_backward)

    def nodes(self) -> list[fx.Node]:
        extra = [n for n in (self.offsets, self.per_sample_weights) if n is not None]
        return [self.ids, self.grad, *extra]


class _Dense(Exception):
    """A recognised table gradient that must stay dense; the message is the reason."""


def _named_args(node: fx.Node) -> dict[str, Any]:
    schema = node.target._schema  # type: ignore[union-attr]
    out = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    out.update(zip((a.name for a in schema.arguments), node.args))
    out.update(node.kwargs)
    return out


def _counts_ids(values: fx.Node, ids: fx.Node, rows: int) -> bool:
    """Whether ``values`` depends on an id count over the table (``scale_grad_by_freq``'s decomposition:
    ``zeros(rows).index_put([ids], ones, accumulate=True)``), looking through backward-phase nodes."""
    seen: set[fx.Node] = set()
    todo = [values]
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function" or n.meta.get(PHASE_KEY) != "backward":
            continue
        seen.add(n)
        if n.target in _INDEX_PUTS:
            base = n.args[0]
            val = base.meta.get("val") if isinstance(base, fx.Node) else None
            if isinstance(val, torch.Tensor) and val.dim() == 1 and val.shape[0] == rows:
                return True
        todo.extend(a for a in n.all_input_nodes)
    return False


def _grad_terms(node: fx.Node) -> list[_Term] | None:
    """The lookups that make up a dense table gradient, or None if ``node`` is not one.

    Accepted: ``zeros(rows, D)`` plus any sum/chain of ``index_add(0, ids, g)`` (the recir::embedding*
    backward), ``index_put([ids], g, accumulate=True)`` (``nn.Embedding``'s ``embedding_dense_backward``
    as capture decomposes it; its padding_idx mask is already in ``g``) and ``_embedding_bag_backward``
    (``nn.EmbeddingBag`` sum/mean, kept whole by capture). Raises :class:`_Dense` with the reason for a
    recognised gradient that has no row-wise form (sparse=True, mode='max', scale_grad_by_freq).
    """
    if node.op != "call_function":
        return None
    if node.target in _ZEROS:
        return []
    if node.target in (aten.full.default, aten.new_full.default) and node.args[-1] == 0:
        return []
    if node.target == aten.index_add.default and node.args[1] == 0 and len(node.args) == 4:
        base = _grad_terms(node.args[0])
        return None if base is None else [*base, _Term(node.args[2], node.args[3])]
    if node.target in _INDEX_PUTS:
        a = _named_args(node)
        indices, values = a["indices"], a["values"]
        if not a["accumulate"] or len(indices) != 1 or not isinstance(indices[0], fx.Node):
            return None
        ids = indices[0]
        rows, *row_shape = node.meta["val"].shape
        if tuple(values.meta["val"].shape) != (*ids.meta["val"].shape, *row_shape):
            return None
        base = _grad_terms(a["self"])
        if base is None:
            return None
        if _counts_ids(values, ids, rows):
            raise _Dense(
                "nn.Embedding(scale_grad_by_freq=True): each id's gradient is divided by its count, "
                "taken over all the table's rows"
            )
        return [*base, _Term(ids, values, aten_lookup=True)]
    if node.target == aten._embedding_bag_backward.default:
        a = _named_args(node)
        if a["sparse"]:
            raise _Dense("nn.EmbeddingBag(sparse=True): its gradient is a sparse COO tensor")
        if a["scale_grad_by_freq"]:
            raise _Dense(
                "nn.EmbeddingBag(scale_grad_by_freq=True): each id's gradient is divided by its count, "
                "taken over all the table's rows"
            )
        if a["mode"] not in (0, 1):
            raise _Dense("nn.EmbeddingBag(mode='max'): each dimension's gradient goes to its own argmax row")
        psw = a["per_sample_weights"]
        bag = (int(a["mode"]), int(a["padding_idx"]), psw is not None)
        return [_Term(a["indices"], a["grad"], a["offsets"], psw, bag, aten_lookup=True)]
    if node.target == aten._sparse_coo_tensor_with_dims_and_tensors.default:
        raise _Dense("nn.Embedding(sparse=True): its gradient is a sparse COO tensor")
    if node.target == aten.add.Tensor and len(node.args) == 2 and not node.kwargs:
        parts = [_grad_terms(a) if isinstance(a, fx.Node) else None for a in node.args]
        if parts[0] is None or parts[1] is None:
            return None
        return parts[0] + parts[1]
    return None


def _per_id_grads(term: _Term, xs: list[torch.Tensor], dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [N], gradient rows [N, D])`` of one term from its traced inputs (``term.nodes()`` order)."""
    ids, g = xs[0].reshape(-1), xs[1]
    if term.bag is None:
        return ids, g.reshape(-1, dim)
    # nn.EmbeddingBag (ATen's _embedding_bag_dense_backward for sum/mean): id i of bag b gets
    # grad[b] (x its per-sample weight; / the bag's count of non-padding ids for mean); padding ids get 0.
    mode, padding_idx, has_psw = term.bag
    offsets = xs[2]
    bags = g.shape[0]  # offsets has B entries, or B + 1 with include_last_offset
    bag = bag_segment_ids(offsets, ids.shape[0]).clamp_max(bags - 1)
    rows = g.index_select(0, bag)
    if has_psw:
        rows = rows * xs[3].unsqueeze(1).to(rows.dtype)
    keep = ids != padding_idx
    if mode == 1:
        size = rows.new_zeros(bags).index_add(0, bag, keep.to(rows.dtype))
        rows = rows / size.index_select(0, bag).clamp(min=1).unsqueeze(1)
    return ids, torch.where(keep.unsqueeze(1), rows, torch.zeros_like(rows))


def _update_fn(
    kind: str,
    hp: dict[str, Any],
    keys: list[str],
    terms: list[_Term],
    has_step: bool,
    core_shape: tuple[int, int],
    element: tuple[int, int, int] | None = None,
) -> Any:
    """``(param, *states, lr, [step], *ids, *grads) -> [new_param, *new_states]`` for one table."""
    rows, dim = core_shape
    n_state = len(keys)

    def fn(*xs: Any) -> list[torch.Tensor]:
        param, states = xs[0], list(xs[1 : 1 + n_state])
        lr_v = xs[1 + n_state]
        k = 2 + n_state
        step_v = xs[k] if has_step else None
        k += int(has_step)
        id_parts, g_parts = [], []
        for term in terms:
            n = len(term.nodes())
            ids_t, g_t = _per_id_grads(term, list(xs[k : k + n]), dim)
            id_parts.append(ids_t.to(torch.int64))
            g_parts.append(g_t)
            k += n
        ids, g = torch.cat(id_parts), torch.cat(g_parts)
        shapes = [param.shape] + [s.shape for s in states]
        # A flat table (FBGEMM TBE's 1-D weights) is updated as its [rows, D] view.
        flat = param.dim() != 2
        p2 = param.reshape(rows, dim) if flat else param
        s2 = [s.reshape(rows, dim) if flat and s.numel() == rows * dim else s for s in states]
        g = g.to(
            torch.float32 if p2.dtype in LOW_PRECISION_BITS else p2.dtype
        )  # fp16/bf16 tables: fp32 maths
        new_p, new_st = sparse_update(kind, hp, p2, dict(zip(keys, s2)), lr_v, step_v, ids, g, element)
        new = [new_p] + [new_st[key] for key in keys]
        return [t.reshape(sh) if tuple(t.shape) != tuple(sh) else t for t, sh in zip(new, shapes)]

    return fn


def _describe(node: fx.Node) -> str:
    return (
        f"%{node.name} = {getattr(node.target, '__name__', node.target)}"
        if node.op == "call_function"
        else node.op
    )


def _is_lookup(target: Any) -> bool:
    if target in _LOOKUPS:
        return True
    return (
        isinstance(target, torch._ops.OpOverload)
        and target.namespace == "recir"
        and "embedding" in target.name()
    )


def embedding_tables(step: StepGraph) -> dict[str, str]:
    """``param slot -> module path`` of every table: a parameter a lookup reads as its weight.

    Lookups are the ``recir::*embedding*`` override ops, and ATen's ``embedding`` / ``_embedding_bag``
    run by the module that owns the weight as ``weight`` (a plain ``nn.Embedding`` / ``nn.EmbeddingBag``:
    the lookup's ``recir.scope`` is the slot's module). ``F.embedding(ids, self.some_param)`` on a raw
    parameter is no table: it stays a dense parameter (DLRMv3's position and time embeddings, trained
    by dense Adam like the reference). The weight may pass through views, detach or alias.
    """
    names = step.signature.state_names()
    placeholders = [n for n in step.graph.nodes if n.op == "placeholder"]
    out: dict[str, str] = {}
    for ph, name in zip(placeholders, names):
        slot = parse_slot_name(name)
        if slot.kind != "param" or slot.path is None:
            continue
        path = slot.path
        todo, seen = [ph], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for user in n.users:
                if user.op != "call_function":
                    continue
                if user.target in _VIEWS or user.target in _SAME:
                    todo.append(user)
                elif _is_lookup(user.target) and user.args and user.args[0] is n:
                    module, _, attr = path.rpartition(".")
                    recir_op = user.target not in _LOOKUPS
                    if recir_op or (attr == "weight" and user.meta.get(SCOPE_KEY) == module):
                        out[name] = module
    return out


@register_transform
class SparsifyUpdate(Transform):
    """Replace each table's dense gradient and optimizer update by row-wise updates of touched rows.

    Matches, per param slot ``p`` (from ``step.meta[OPTIMIZER_KEY]``), the gradient node
    (``GRAD_OF_KEY == p``) of the form ``zeros(rows, D).index_add(0, ids, g)`` (recir::embedding*
    overrides), ``zeros(rows, D).index_put([ids], g, accumulate=True)`` (plain ``nn.Embedding``:
    ``embedding_dense_backward`` as capture decomposes it, padding ids already masked in ``g``) or
    ``_embedding_bag_backward`` (plain ``nn.EmbeddingBag`` sum/mean, per-sample weights, padding_idx:
    each id gets its bag's gradient row) -- several terms, and a trailing view, are accepted -- whose
    only users are ``p``'s optimizer nodes. ``stats["dense_tables"]`` lists the tables (params a lookup
    reads, see :func:`embedding_tables`) left dense, with the reason. Before -> after::

        %gw = index_add(new_zeros(W, [R, D]), 0, %ids, %g)        # backward
        %m1 = add(mul(%exp_avg, 0.9), mul(%gw, 0.1)) ...          # optimizer, O(R*D)
        %w1 = sub(%W, ...)
        ->
        %s, %perm = sort(%ids); %slot = cumsum(%s[1:] != %s[:-1]) ...   # N = len(ids) slots
        %gs = new_zeros([N, D]).index_add(0, %slot, %g[%perm])            # segment sum per row
        %w1 = index_put(%W, [%rows], where(%valid, update(%W[%rows], %gs) - %W[%rows], 0), True)  # accumulate

    SGD/Adagrad/RowWiseAdagrad match the dense maths exactly. Adam/AdamW are lazy (``lazy_adam``):
    rows absent from the batch keep weights and moments, where dense Adam would still decay the
    moments and move those rows (torch.optim.SparseAdam's semantics). Weight decay (any optimizer)
    reaches touched rows only (``lazy_weight_decay``), as FBGEMM's fused optimizers do. Padding ids
    of a ``JaggedBatch`` repeat a real id, so they touch no extra row.
    """

    name = "recir-embed-sparsify-update"
    summary = "dense embedding gradient + optimizer -> dedupe ids, segment-sum, row-wise update, index_put(accumulate)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        min_rows: int = 1  # tables with fewer rows stay dense
        lazy_adam: bool = True  # allow Adam/AdamW (lazy semantics on untouched rows)
        lazy_weight_decay: bool = True  # allow weight decay applied to touched rows only

    def requires(self, step: StepGraph) -> None:
        if OPTIMIZER_KEY not in step.meta:
            raise ConfigError(
                f"{self.name}: the step has no meta[{OPTIMIZER_KEY!r}] (param slot -> optimizer); "
                "capture it with recir.capture.capture_train_step"
            )

    def run(self, step: StepGraph) -> TransformResult:
        graph = step.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        output = next(n for n in graph.nodes if n.op == "output")
        outs = list(output.args[0])
        names = step.signature.state_names()
        grads = grad_nodes(step)
        done: list[str] = []
        skipped: dict[str, str] = {}
        ids_per_table: dict[str, int] = {}
        tables = embedding_tables(step)
        for slot, info in optimizer_infos(step).items():
            reason, plan = self._match(step, slot, info, grads, tables)
            if plan is None:
                skipped[slot] = reason
                continue
            core_shape, terms = plan
            kind, hp = info.kind, dict(info.hparams)
            if kind == "sgd" and hp.get("momentum"):
                skipped[slot] = "SGD with momentum decays every row's buffer (not row-wise)"
                continue
            if hp.get("weight_decay") and not self.options.lazy_weight_decay:
                skipped[slot] = "weight decay reaches every row densely (lazy_weight_decay=False)"
                continue
            keys = list(info.state)
            state_slots = [info.state[key] for key in keys]
            idx = [names.index(slot)] + [names.index(s) for s in state_slots]
            lr = placeholders[names.index(info.lr_slot)]
            step_node = outs[names.index(info.step_slot)] if info.step_slot else None
            args = [placeholders[i] for i in idx] + [lr] + ([step_node] if step_node is not None else [])
            args += [n for t in terms for n in t.nodes()]
            element = step.meta.get(TABLE_ELEMENTS_KEY, {}).get(slot)
            fn = _update_fn(kind, hp, keys, terms, step_node is not None, core_shape, element)
            for t in terms:
                t.grad.meta[ROW_GRAD_KEY] = [*t.grad.meta.get(ROW_GRAD_KEY, []), (slot, t.ids.name)]
            new_nodes = splice(graph, fn, args, before=output, phase="optimizer", provenance=self.name)
            for i, node in zip(idx, new_nodes):
                outs[i] = node
            done.append(slot)
            ids_per_table[slot] = sum(t.ids.meta["val"].numel() for t in terms)
        if done:
            output.args = (tuple(outs),)
            graph.eliminate_dead_code()
            graph.lint()
            step.graph_module.recompile()
        dense_tables = {slot: skipped[slot] for slot in tables if slot in skipped}
        stats = {
            "sparsified": done,
            "skipped": skipped,
            "ids": ids_per_table,
            "tables": tables,
            "dense_tables": dense_tables,
        }
        return TransformResult(step, bool(done), stats)

    def _match(
        self,
        step: StepGraph,
        slot: str,
        info: OptimizerInfo,
        grads: dict[str, fx.Node],
        tables: dict[str, str],
    ) -> tuple[str, tuple[tuple[int, int], list[_Term]] | None]:
        kind = info.kind
        if kind not in SPARSE_KINDS:
            return f"optimizer {kind!r} has no row-wise form", None
        if kind in ("adam", "adamw") and not self.options.lazy_adam:
            return "Adam is only row-wise with lazy semantics (lazy_adam=False)", None
        grad = grads.get(slot)
        if grad is None:
            return f"no node carries {GRAD_OF_KEY} for it", None
        core = grad
        while core.op == "call_function" and core.target in _VIEWS:
            core = core.args[0]
        try:
            terms = _grad_terms(core)
        except _Dense as e:
            return str(e), None
        if terms and any(t.aten_lookup for t in terms) and slot not in tables:
            return (
                "an ATen lookup or indexing of a parameter that is no nn.Embedding/nn.EmbeddingBag weight "
                "(e.g. F.embedding(ids, self.param)): it stays a dense parameter"
            ), None
        if not terms:
            return (
                "its gradient is none of zeros.index_add(0, ids, g), zeros.index_put([ids], g, "
                f"accumulate=True) or _embedding_bag_backward (it is {_describe(core)})"
            ), None
        shape = tuple(core.meta["val"].shape)
        if len(shape) != 2 or shape[0] < self.options.min_rows:
            return f"gradient shape {list(shape)} is not a [rows >= {self.options.min_rows}, D] table", None
        for user in grad.users:
            if user.op != "output" and optim_param(user) != slot:
                return f"its gradient also feeds {user.name} (not {slot}'s optimizer update)", None
        return "", (shape, terms)
