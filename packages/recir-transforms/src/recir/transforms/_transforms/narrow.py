"""``recir-cleanup-narrow``: compute only the part of a value that a slice keeps.

A serving graph often computes every token's row and then keeps a few: DLRMv3's last STU layer runs
the whole sequence through its attention, norms and output projection, and its head reads only the
candidates' rows (``x[:, n_history:]``). Dead-code elimination cannot remove the other rows, since
they live in the same tensors. This transform moves each such slice up the graph, through the ops
that treat the sliced axis row by row (elementwise ops with broadcasting, products on their row
operand, norms and reductions over other axes, concatenation and splits along other axes, views,
permutes and expands), so those ops run on the kept rows only; where a value is also read whole,
the slice is taken there instead.

Reshapes that merge the sliced axis with the axes before it (``[B, T, D] -> [B*T, D]`` around a
product) are followed: a narrowing carries ``lead``, the number of blocks of the axis (``B`` here), and
keeps rows ``start:stop`` of each block.

Exact: every narrowed op computes the same values on the kept rows (the same operations in the same
order per row; a product's row does not depend on the other rows). Random ops and ops with mutable
schemas are never narrowed.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from .._errors import RecIRError
from .._graph_util import call_like, node_val
from .._step import StepGraph
from .._transform import Transform, TransformResult, register_transform
from .dce import DeadCodeElimination

aten = torch.ops.aten

# Unary ops that keep the shape and are not tagged pointwise.
_UNARY = {aten._to_copy.default, aten.alias.default, aten.clone.default, aten.contiguous.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default}
# Ops `(weight, indices, ...) -> rows` whose output row i is `weight`'s row named by index i (lookups):
# narrowed through their indices. `narrow_through_indices` adds one (recir-embedding's lookup op).
_GATHERS: set[Any] = {aten.embedding.default}


def narrow_through_indices(op: Any) -> None:
    """Let ``recir-cleanup-narrow`` narrow ``op`` (an OpOverload ``(weight, indices, ...) -> rows``, e.g.
    an embedding lookup whose output leads with the indices' shape) by narrowing its indices."""
    _GATHERS.add(op)


@dataclasses.dataclass(frozen=True)
class Narrowing:
    """Rows ``start:stop`` of axis ``dim``, seen as ``lead`` blocks of equal size (``lead=1``: a slice)."""

    dim: int
    start: int
    stop: int
    lead: int = 1

    def size(self) -> int:
        return self.lead * (self.stop - self.start)


# A rule: for a node and the narrowing of its output, the narrowings its tensor inputs need (None: read
# whole) and a builder of the narrowed node's (args, kwargs) from `get(input, narrowing) -> node`.
Getter = Callable[[fx.Node, "Narrowing | None"], fx.Node]
Rule = tuple[
    list[tuple[fx.Node, Narrowing | None]], Callable[[Getter], tuple[tuple[Any, ...], dict[str, Any]]]
]


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node_val(node)
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return None  # symbolic shapes: left alone
    return tuple(val.shape)


def _pos(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _broadcast_need(arg: fx.Node, out: tuple[int, ...], nar: Narrowing) -> tuple[bool, Narrowing | None]:
    """(ok, the narrowing ``arg`` needs) for an elementwise input of an output narrowed by ``nar``."""
    shape = _shape(arg)
    if shape is None:
        return False, None
    ax = nar.dim - (len(out) - len(shape))
    if ax < 0 or (shape[ax] == 1 and out[nar.dim] != 1):
        return True, None  # broadcast along the narrowed axis: read whole
    if shape[ax] != out[nar.dim]:
        return False, None
    return True, dataclasses.replace(nar, dim=ax)


def _elementwise(node: fx.Node, nar: Narrowing, out: tuple[int, ...]) -> Rule | None:
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return None
    needs: list[tuple[fx.Node, Narrowing | None]] = []
    for a in node.args:
        if isinstance(a, fx.Node):
            ok, need = _broadcast_need(a, out, nar)
            if not ok:
                return None
            needs.append((a, need))
        elif isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return None
    if all(need is None for _, need in needs):
        return None  # no input carries the narrowed axis (a broadcast or a constructor): nothing to narrow
    table = dict(needs)

    def build(get: Getter) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = tuple(get(a, table[a]) if isinstance(a, fx.Node) else a for a in node.args)
        return args, dict(node.kwargs)

    return needs, build


def _same_args(node: fx.Node, needs: list[tuple[fx.Node, Narrowing | None]], **replace: Any) -> Rule:
    """A rule whose narrowed node is the same op on its narrowed inputs (and ``replace``d literal args by
    position, given as ``a<i>=value``)."""
    table = dict(needs)

    def build(get: Getter) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = list(node.args)
        for i, a in enumerate(args):
            if isinstance(a, fx.Node):
                args[i] = get(a, table.get(a))
            elif isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
                args[i] = type(a)(get(x, table.get(x)) if isinstance(x, fx.Node) else x for x in a)
        for key, value in replace.items():
            args[int(key[1:])] = value
        return tuple(args), dict(node.kwargs)

    return needs, build


def _view_input(inp: tuple[int, ...], out: tuple[int, ...], nar: Narrowing) -> Narrowing | None:
    """The narrowing of a view's input equal to ``nar`` on its output: the same rows of each block, on the
    input axis whose trailing elements match (so the kept flat ranges coincide)."""
    post = math.prod(out[nar.dim + 1 :])
    rows = out[nar.dim] // nar.lead
    for k, size in enumerate(inp):
        if math.prod(inp[k + 1 :]) == post and size % rows == 0 and size != 1:
            return Narrowing(k, nar.start, nar.stop, size // rows)
    return None


def _rule(node: fx.Node, nar: Narrowing) -> Rule | None:
    """How to narrow ``node``'s output by ``nar``, or None where this transform does not know or where
    one input would be needed both narrowed and whole (``x @ x`` narrowed by rows)."""
    rule = _op_rule(node, nar)
    if rule is not None:
        needs: dict[fx.Node, Narrowing | None] = {}
        for inp, need in rule[0]:
            if needs.setdefault(inp, need) != need:
                return None
    return rule


def _op_rule(node: fx.Node, nar: Narrowing) -> Rule | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        if node.op == "call_function" and target is operator.getitem:
            return [(node.args[0], nar)], lambda get: ((get(node.args[0], nar), node.args[1]), {})  # type: ignore[arg-type]
        return None
    if torch.Tag.nondeterministic_seeded in target.tags or target._schema.is_mutable:
        return None
    val = node_val(node)
    ref = val[0] if isinstance(val, (tuple, list)) else val
    if not isinstance(ref, torch.Tensor) or not all(isinstance(s, int) for s in ref.shape):
        return None
    out = tuple(ref.shape)
    args = node.args
    if target in _UNARY or torch.Tag.pointwise in target.tags:
        return _elementwise(node, nar, out)
    if target in _VIEWS:
        inp = _shape(args[0])
        need = None if inp is None else _view_input(inp, out, nar)
        if need is None:
            return None
        shape = list(out)
        shape[nar.dim] = nar.size()
        return _same_args(node, [(args[0], need)], a1=shape)
    if target is aten.permute.default:
        dims = [_pos(d, len(out)) for d in args[1]]
        return _same_args(node, [(args[0], dataclasses.replace(nar, dim=dims[nar.dim]))])
    if target is aten.expand.default:
        ok, need = _broadcast_need(args[0], out, nar)
        if not ok:
            return None
        sizes = list(args[1])
        sizes[nar.dim] = nar.size()
        return _same_args(node, [(args[0], need)], a1=sizes)
    if target is aten.unsqueeze.default:
        k = _pos(args[1], len(out))
        if nar.dim == k:
            return None
        return _same_args(node, [(args[0], dataclasses.replace(nar, dim=nar.dim - (nar.dim > k)))])
    if target is aten.slice.Tensor:
        dim = _pos(args[1] if len(args) > 1 else 0, len(out))
        step = args[4] if len(args) > 4 else 1
        if dim != nar.dim:
            return _same_args(node, [(args[0], nar)])
        inp = _shape(args[0])
        start = _slice_start(args, inp)
        if inp is None or start is None or step != 1 or nar.lead != 1:
            return None
        need = Narrowing(dim, start + nar.start, start + nar.stop)
        return [(args[0], need)], lambda get: get(args[0], need)  # type: ignore[return-value]
    if target in (aten.mm.default, aten.bmm.default):
        rows_of_first = nar.dim == len(out) - 2
        if target is aten.bmm.default and nar.dim == 0:
            return _same_args(node, [(args[0], nar), (args[1], nar)])
        side, other = (args[0], args[1]) if rows_of_first else (args[1], args[0])
        return _same_args(node, [(side, nar), (other, None)])
    if target is aten.addmm.default:
        ok, need = _broadcast_need(args[0], out, nar)
        if not ok:
            return None
        side, other = (args[1], args[2]) if nar.dim == 0 else (args[2], args[1])
        return _same_args(node, [(args[0], need), (side, nar), (other, None)])
    if target is aten.cat.default:
        dim = _pos(args[1] if len(args) > 1 else 0, len(out))
        if any(_shape(t) is None or len(_shape(t) or ()) != len(out) for t in args[0]):
            return None
        if dim == nar.dim:
            return _cat_pieces(node, args[0], dim, nar)
        return _same_args(node, [(t, nar) for t in args[0]])
    if target in _GATHERS:  # (weight, indices, ...): output row i is the row named by index i
        indices = _shape(args[1])
        if indices is None or nar.dim >= len(indices):
            return None
        return _same_args(node, [(args[0], None), (args[1], nar)])
    if target in (aten.split_with_sizes.default, aten.split.Tensor):
        dim = _pos(args[2] if len(args) > 2 else 0, len(out))
        return None if dim == nar.dim else _same_args(node, [(args[0], nar)])
    if target is aten.native_layer_norm.default:
        if nar.dim >= len(out) - len(args[1]):
            return None
        return _same_args(node, [(args[0], nar), *((a, None) for a in args[2:4] if isinstance(a, fx.Node))])
    if target in _REDUCTIONS:
        inp = _shape(args[0])
        if inp is None:
            return None
        axes = args[1] if len(args) > 1 else None
        if axes is None or (isinstance(axes, Sequence) and len(axes) == 0):
            return None
        reduced = {_pos(d, len(inp)) for d in (axes if isinstance(axes, Sequence) else [axes])}
        keepdim = bool(args[2]) if len(args) > 2 else bool(node.kwargs.get("keepdim", False))
        kept = list(range(len(inp))) if keepdim else [d for d in range(len(inp)) if d not in reduced]
        ax = kept[nar.dim]
        if ax in reduced:
            return None
        return _same_args(node, [(args[0], dataclasses.replace(nar, dim=ax))])
    return None


def _cat_pieces(node: fx.Node, pieces: Sequence[fx.Node], dim: int, nar: Narrowing) -> Rule | None:
    """A concatenation narrowed along its own axis: the pieces the rows cover (each narrowed where the
    rows cut it), concatenated again, or the one piece they fall in."""
    if nar.lead != 1:
        return None
    needs: list[tuple[fx.Node, Narrowing | None]] = []
    offset = 0
    for t in pieces:
        size = (_shape(t) or ())[dim]
        lo, hi = max(nar.start, offset), min(nar.stop, offset + size)
        if lo < hi:
            whole = lo == offset and hi == offset + size
            needs.append((t, None if whole else Narrowing(dim, lo - offset, hi - offset)))
        offset += size
    if not needs or len({t for t, _ in needs}) != len(needs):
        return None
    if len(needs) == 1:
        ((piece, need),) = needs
        return needs, lambda get: get(piece, need)  # type: ignore[return-value]
    return needs, lambda get: (([get(t, need) for t, need in needs], dim), {})


def _slice_start(args: Sequence[Any], shape: tuple[int, ...] | None) -> int | None:
    if shape is None:
        return None
    dim = _pos(args[1] if len(args) > 1 else 0, len(shape))
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    if not isinstance(start, int):
        return None
    return max(0, min(start + shape[dim] if start < 0 else start, shape[dim]))


def _seed(node: fx.Node) -> Narrowing | None:
    """The narrowing a slice node (whose own output is read whole) asks of its input: a proper step-1
    slice of static bounds."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return None
    args = node.args
    shape = _shape(args[0])  # type: ignore[arg-type]
    step = args[4] if len(args) > 4 else 1
    start = _slice_start(args, shape)
    stop = args[3] if len(args) > 3 else None
    if shape is None or start is None or step != 1 or not isinstance(stop, (int, type(None))):
        return None
    dim = _pos(args[1] if len(args) > 1 else 0, len(shape))
    size = shape[dim]
    stop = size if stop is None else max(0, min(stop + size if stop < 0 else stop, size))
    if stop <= start or (start == 0 and stop == size):
        return None
    return Narrowing(dim, start, stop)


@register_transform
class Narrow(Transform):
    """Compute only the rows of a value that a slice keeps (see the module docstring).

    Before::

        %mm = aten.mm(%x, %w)  # forward                  [776, 64]
        %view = aten.view(%mm, [4, 194, 64])  # forward
        %add = aten.add.Tensor(%res, %view)  # forward
        %slice = aten.slice.Tensor(%add, 1, 130, 194)  # forward

    After::

        %view_1 = aten.view(%x, [4, 194, 192])  # forward    (x = view(cat, [776, 192]) followed the same way)
        %slice_1 = aten.slice.Tensor(%view_1, 1, 130, 194)
        ...
        %mm_1 = aten.mm(%view_2, %w)  # forward               [256, 64]
        %view_3 = aten.view(%mm_1, [4, 64, 64])  # forward
        %add_1 = aten.add.Tensor(%slice_2, %view_3)  # forward   (res is also read whole: sliced there)
    """

    name = "recir-cleanup-narrow"
    summary = "compute only the rows of a value that a slice keeps (e.g. a serving head's candidate rows)"

    @dataclasses.dataclass(frozen=True)
    class Options:
        #: A value whose readers want disjoint row ranges of it (a history's rows and the candidates'):
        #: computed as one value per range (split), instead of whole.
        split: bool = False

    def run(self, step: StepGraph) -> TransformResult:
        graph = step.graph
        nodes = list(graph.nodes)
        # what each node's readers need of it: the row ranges to compute it as (() = whole)
        request: dict[fx.Node, tuple[Narrowing, ...]] = {}
        rules: dict[tuple[fx.Node, Narrowing], Rule | None] = {}
        for node in reversed(nodes):  # users first
            asks: set[Narrowing | None] = set()
            for user in node.users:
                if user.op == "call_function" and not user.users:
                    continue  # dead (an unread getitem of a norm's statistics): asks for nothing
                for nar in request.get(user) or (None,):
                    asks.add(self._need(user, node, nar, rules))
            request[node] = self._choose(asks) if node.op == "call_function" else ()

        narrowed: dict[tuple[fx.Node, Narrowing], fx.Node] = {}
        slices: dict[tuple[fx.Node, Narrowing], fx.Node] = {}
        reader: list[fx.Node] = []  # the node being narrowed: a slice it reads takes its metadata

        def get(node: fx.Node, nar: Narrowing | None) -> fx.Node:
            if nar is None:
                return node
            if (node, nar) in narrowed:
                return narrowed[(node, nar)]
            key = (node, nar)
            if key not in slices:
                slices[key] = self._materialise(graph, node, nar, reader[-1])
            return slices[key]

        for node in nodes:
            for nar in request.get(node, ()):
                rule = rules.get((node, nar))
                if rule is None:
                    continue  # read as a slice of the whole value (get)
                if node.target is operator.getitem and (node.args[0], nar) not in narrowed:
                    continue
                reader.append(node)
                with graph.inserting_before(node):
                    built = rule[1](get)
                    if isinstance(built, fx.Node):  # a slice of a slice (or of a concatenation): its input
                        narrowed[(node, nar)] = built
                        continue
                    narrowed[(node, nar)] = new = call_like(graph, node, node.target, *built)
                _check_rows(node, new, nar)
            if not request.get(node) and (seed := _seed(node)) is not None:
                base: fx.Node = node.args[0]  # type: ignore[assignment]
                if (base, seed) in narrowed:  # a slice read whole: its value is the narrowed input
                    node.replace_all_uses_with(narrowed[(base, seed)])
        if not narrowed:
            return TransformResult(step, changed=False, stats={"narrowed": 0})
        DeadCodeElimination().run(step)
        step.graph_module.recompile()
        split = sum(len(r) > 1 for r in request.values())
        return TransformResult(
            step, changed=True, stats={"narrowed": len(narrowed), "slices": len(slices), "split": split}
        )

    def _choose(self, asks: set[Narrowing | None]) -> tuple[Narrowing, ...]:
        """The row ranges to compute a value as, from what its readers ask: the one range all ask; with
        ``split``, several disjoint ranges of one axis (each computed apart); else whole."""
        wanted = [n for n in asks if n is not None]
        if len(wanted) != len(asks) or not wanted:  # a reader wants the value whole
            return ()
        if len(wanted) == 1:
            return (wanted[0],)
        ranges = sorted(wanted, key=lambda n: (n.dim, n.lead, n.start))
        same_axis = len({(n.dim, n.lead) for n in ranges}) == 1
        disjoint = all(a.stop <= b.start for a, b in zip(ranges, ranges[1:]))
        return tuple(ranges) if self.options.split and same_axis and disjoint else ()

    @staticmethod
    def _need(
        user: fx.Node,
        node: fx.Node,
        nar: Narrowing | None,
        rules: dict[tuple[fx.Node, Narrowing], Rule | None],
    ) -> Narrowing | None:
        """What ``user`` (whose own output is narrowed by ``nar``, or read whole) needs of ``node``."""
        if user.op != "call_function":
            return None
        if nar is None:
            seed = _seed(user)
            return seed if seed is not None and user.args[0] is node else None
        if (user, nar) not in rules:
            rules[(user, nar)] = _rule(user, nar)
        rule = rules[(user, nar)]
        if rule is None:
            return None
        needs = {need for inp, need in rule[0] if inp is node}
        return next(iter(needs)) if len(needs) == 1 else None

    @staticmethod
    def _materialise(graph: fx.Graph, node: fx.Node, nar: Narrowing, reader: fx.Node) -> fx.Node:
        """``node`` narrowed by ``nar``, at the graph's insertion point (before ``reader``, whose phase
        and metadata it takes): a slice (a view), or for ``lead > 1`` the rows of each block copied out."""
        if nar.lead == 1:
            return call_like(graph, reader, aten.slice.Tensor, (node, nar.dim, nar.start, nar.stop), {})
        shape = list(_shape(node) or ())
        blocks = shape[: nar.dim] + [nar.lead, shape[nar.dim] // nar.lead] + shape[nar.dim + 1 :]
        rows = shape[: nar.dim] + [nar.size()] + shape[nar.dim + 1 :]
        cur = call_like(graph, reader, aten.reshape.default, (node, blocks), {})
        cur = call_like(graph, reader, aten.slice.Tensor, (cur, nar.dim + 1, nar.start, nar.stop), {})
        cur = call_like(graph, reader, aten.clone.default, (cur,), {"memory_format": torch.contiguous_format})
        return call_like(graph, reader, aten.view.default, (cur, rows), {})


def _check_rows(old: fx.Node, new: fx.Node, nar: Narrowing) -> None:
    """The narrowed node has the old one's shape with ``nar``'s axis shortened (each output of a tuple)."""
    olds, news = node_val(old), node_val(new)
    olds, news = (olds, news) if isinstance(olds, (tuple, list)) else ((olds,), (news,))
    for a, b in zip(olds, news):
        if not isinstance(a, torch.Tensor):
            continue
        want = list(a.shape)
        want[nar.dim] = nar.size()
        if not isinstance(b, torch.Tensor) or list(b.shape) != want:
            got = list(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            raise RecIRError(
                f"recir-cleanup-narrow: %{old.name} narrowed by {nar} computes {got}, expected {want}. "
                "This is a bug in the transform's rule for "
                f"{old.target}; skip the transform (to_inference(..., narrow=False)) and report it"
            )
