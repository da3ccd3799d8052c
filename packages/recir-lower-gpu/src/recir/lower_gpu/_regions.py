"""Compile each repeated module region once (``GPUOptions(regions="repeated")``).

A model built from N identical layers (an ``nn.ModuleList``) hands Inductor N copies of the same
forward, backward and optimizer code, and Inductor lowers, schedules and generates code for every copy
(Python time that grows with the graph; identical C++ kernels it already compiles once). Here the step
is cut into pieces instead: the nodes of one repeated module instance (a module path with an integer
index, ``layers.3``) in one phase form a piece, and the glue between them forms pieces too; the nodes
are first put in a topological order that keeps each instance's nodes together. Pieces that are the
same code up to integer constants (dropout counter offsets differ per layer) become one GraphModule
whose differing constants are 0-d tensor inputs, and each distinct piece is compiled once::

    forward:  [glue] [layers.0] [layers.1] ... [layers.4] [glue]      5 layer pieces -> 1 compile
    backward: [glue] [layers.4] ... [layers.0] [glue]                 (the last layer's may differ)
    optimizer:[glue] [layers.0] ... [layers.4] [glue]                 5 -> 1

An instance's piece whose nodes are its siblings' plus some that read nothing else of it (DLRMv3's
first layer also builds the step's dropout key) runs those extra nodes as glue before it, and then
shares their code; such a hoist is kept only when the codes then match.

The pieces run in order, each value freed after its last reader. Each new state value is written into
its input (``copy_``) by the piece that computes it, or by the last piece that reads the old value.
"""

from __future__ import annotations

import dataclasses
import difflib
import heapq
import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import PHASE_KEY, SCOPE_KEY, alias_chain, lazy_graph_module

_INDEXED = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # the outermost module path with an integer index
_LIFTABLE = {torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor}
_Key = tuple[str, str] | None  # (phase, module instance) or None: glue
_MIN_NODES = 16


def _instance(node: fx.Node) -> str | None:
    m = _INDEXED.match(str(node.meta.get(SCOPE_KEY, "")))
    return m.group(1) if m else None


def _keys(nodes: Sequence[fx.Node]) -> dict[fx.Node, _Key]:
    """Each node's piece key: (phase, instance) for the instances of a repeated module (at least two,
    each with at least ``_MIN_NODES`` forward nodes: a Sequential's small children stay glue), else None."""
    instances = {n: _instance(n) for n in nodes}
    forward: dict[str, int] = {}
    for n, inst in instances.items():
        if inst is not None and n.meta.get(PHASE_KEY) == "forward":
            forward[inst] = forward.get(inst, 0) + 1
    family: dict[str, list[int]] = {}
    for inst, count in forward.items():
        family.setdefault(_family(inst), []).append(count)
    repeated = {f for f, counts in family.items() if len(counts) > 1 and min(counts) >= _MIN_NODES}
    return {
        n: (str(n.meta.get(PHASE_KEY)), inst) if inst is not None and _family(inst) in repeated else None
        for n, inst in instances.items()
    }


def _family(instance: str) -> str:
    return re.sub(r"\d+$", "*", instance)


def _reorder(nodes: list[fx.Node], keys: dict[fx.Node, _Key]) -> list[fx.Node]:
    """A topological order of ``nodes`` in which each instance's nodes run together: glue nodes keep the
    graph's order (none is hoisted), an instance, once started, takes every node of its that is ready."""
    index = {n: i for i, n in enumerate(nodes)}
    pending = {n: sum(1 for a in n.all_input_nodes if a in index) for n in nodes}
    ready: list[int] = [index[n] for n in nodes if pending[n] == 0]
    heapq.heapify(ready)
    by_key: dict[_Key, list[int]] = {}
    order: list[fx.Node] = []
    current: _Key = None

    def release(n: fx.Node) -> None:
        for u in n.users:
            if u in pending:
                pending[u] -= 1
                if pending[u] == 0:
                    heapq.heappush(ready, index[u])
                    if keys[u] is not None:
                        heapq.heappush(by_key.setdefault(keys[u], []), index[u])

    for i in ready:
        if keys[nodes[i]] is not None:
            by_key.setdefault(keys[nodes[i]], []).append(i)
    for h in by_key.values():
        heapq.heapify(h)
    done: set[int] = set()
    while len(order) < len(nodes):
        own = by_key.get(current) if current is not None else None
        while own and own[0] in done:
            heapq.heappop(own)
        if own:
            i = heapq.heappop(own)
        else:
            while ready[0] in done:
                heapq.heappop(ready)
            i = heapq.heappop(ready)
            current = keys[nodes[i]]
        done.add(i)
        order.append(nodes[i])
        release(nodes[i])
    return order


@dataclasses.dataclass
class _Piece:
    key: _Key
    nodes: list[fx.Node]
    inputs: list[fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[fx.Node] = dataclasses.field(default_factory=list)
    copies: list[tuple[fx.Node, fx.Node]] = dataclasses.field(default_factory=list)  # (state input, new)


class RegionSplit:
    """The step's pieces, their distinct codes, and the order to run them in (see the module doc)."""

    codes: list[str]  # per piece: equal codes compile once
    lifted: list[list[Any]]  # per piece: its lifted integer constants
    lift: list[tuple[bool, ...]]  # per piece: which of its liftable constants are lifted
    lift_dtypes: list[list[torch.dtype]]

    def __init__(self, gm: fx.GraphModule, num_state: int) -> None:
        graph = gm.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        body = [n for n in graph.nodes if n.op == "call_function"]
        output = graph.output_node()
        self._flat = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
        self._num_state = num_state
        self._order_of = {n: k for k, n in enumerate(graph.nodes)}
        keys = _keys(body)
        order = _reorder(body, keys)
        groups: list[tuple[_Key, list[fx.Node]]] = []
        group_of: dict[fx.Node, int] = {}
        for n in order:
            parent = n.args[0] if n.target is operator.getitem else None
            if isinstance(parent, fx.Node) and parent in group_of:  # tuples never cross pieces
                group_of[n] = group_of[parent]
                groups[group_of[n]][1].append(n)
                continue
            if not groups or groups[-1][0] != keys[n]:
                groups.append((keys[n], []))
            group_of[n] = len(groups) - 1
            groups[-1][1].append(n)
        self.reason = _unsupported(graph, self._flat, num_state, self.placeholders, body)
        self.pieces = [_Piece(k, list(nodes)) for k, nodes in groups]
        if self.reason is not None:
            return
        # the last piece that reads each state input, or a view of it
        self._base = {n: alias_chain(n)[-1] for n in body}
        self.hoisted = 0  # nodes moved out of an instance's piece so that it shares its siblings' code
        if not self._assemble(groups):
            return
        # An instance's piece whose code differs from its siblings' only by nodes that need nothing else of
        # it (DLRMv3: the layer before the last scatters the last layer's candidate-row gradients back into
        # all rows) shares their code once those nodes run as glue before it: one compile fewer.
        for key, sibling in _outliers(self.pieces, self.codes):
            trial = _hoisted(groups, key, sibling)
            if trial is None:
                continue
            regrouped, moved = trial
            before = (self.pieces, self.codes, self.lifted, self.lift, self.lift_dtypes)
            if (
                self._assemble(regrouped)
                and (code := self._code_of(key)) is not None
                and code == self._code_of(sibling)
            ):
                groups, self.hoisted = regrouped, self.hoisted + moved
            else:  # not the siblings' code after all: the pieces as they were
                self.reason = None
                self.pieces, self.codes, self.lifted, self.lift, self.lift_dtypes = before

    def _code_of(self, key: _Key) -> str | None:
        found = [c for p, c in zip(self.pieces, self.codes) if p.key == key]
        return found[0] if len(found) == 1 else None

    def _assemble(self, groups: list[tuple[_Key, list[fx.Node]]]) -> bool:
        """The pieces of ``groups`` with their inputs, outputs, state copies and codes; False (and
        ``reason`` set) when a value without a tensor example crosses pieces."""
        flat, num_state, base = self._flat, self._num_state, self._base
        pieces = [_Piece(k, list(nodes)) for k, nodes in groups]
        piece_of = {n: i for i, p in enumerate(pieces) for n in p.nodes}
        last_read: dict[fx.Node, int] = {}
        for n in piece_of:
            for a in n.all_input_nodes:
                root = base.get(a, a)
                if root.op == "placeholder":
                    last_read[root] = max(last_read.get(root, -1), piece_of[n])
        for ph, new in zip(self.placeholders[:num_state], flat[:num_state]):
            if new is ph:
                continue
            at = max(piece_of[new], last_read.get(ph, -1))
            pieces[at].copies.append((ph, new))
        final = [v for v in flat[num_state:] if isinstance(v, fx.Node)]
        for p in pieces:
            # A view of an input made in another piece is made again here, from the input: the piece then
            # sees the aliasing (a state input it updates in place and a view of it read before).
            views = {
                v
                for n in p.nodes
                for a in n.all_input_nodes
                if a in base
                and base[a] is not a
                and base[a].op == "placeholder"
                and piece_of[a] != piece_of[n]
                for v in _view_nodes(a)
            }
            p.nodes = sorted(views, key=self._order_of.__getitem__) + [n for n in p.nodes if n not in views]
        for p in pieces:
            local = set(p.nodes)
            seen: set[fx.Node] = set()
            reads = [a for n in p.nodes for a in n.all_input_nodes] + [x for c in p.copies for x in c]
            for a in reads:
                if a not in local and a not in seen:
                    seen.add(a)
                    p.inputs.append(a)
        for i, p in enumerate(pieces):
            read_later = {a for q in pieces[i + 1 :] for a in q.inputs}
            p.outputs = [n for n in p.nodes if (n in final or n in read_later) and piece_of[n] == i]
        self.pieces = pieces
        self.final = final
        self.user_outputs = flat[num_state:]
        crossing = next(
            (a for p in pieces for a in p.inputs if not isinstance(a.meta.get("val"), torch.Tensor)), None
        )
        if crossing is not None:
            self.reason = f"node %{crossing.name} crosses pieces without a tensor example value"
            return False
        self.codes, self.lifted, self.lift = _codes(pieces)
        # the dtype of each lifted constant (that of the integer tensor it is added to), per piece
        self.lift_dtypes = [
            [n.args[0].meta["val"].dtype for n, m in zip(_lift_nodes(p), self.lift[i]) if m]  # type: ignore[union-attr]
            for i, p in enumerate(pieces)
        ]
        return True

    def graph_module(self, i: int) -> fx.GraphModule:
        """Piece ``i`` as a GraphModule: its inputs, then its lifted constants, as placeholders."""
        p = self.pieces[i]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for j, a in enumerate(p.inputs):
            env[a] = graph.placeholder(f"x{j}")
        lifts = iter(self.lift[i])
        extra: list[fx.Node] = []

        def arg(a: Any) -> Any:
            return fx.node.map_aggregate(a, lambda x: env[x] if isinstance(x, fx.Node) else x)

        for k, n in enumerate(p.nodes):
            args = [arg(a) for a in n.args]
            if _liftable(n) and next(lifts):
                ph = graph.placeholder(f"k{len(extra)}")
                extra.append(ph)
                args[1] = ph
            new = graph.create_node(
                "call_function",
                n.target,
                tuple(args),
                {k2: arg(v) for k2, v in n.kwargs.items()},
                name=f"n{k}",
            )
            new.meta["val"] = n.meta.get("val")
            env[n] = new
        for dst, src in p.copies:
            graph.call_function(torch.ops.aten.copy_.default, (env[dst], env[src]))
        graph.output(tuple(env[o] for o in p.outputs))
        _placeholders_first(graph)
        return lazy_graph_module(torch.nn.Module(), graph)  # code written once, for the cache key


def _node_key(n: fx.Node) -> tuple[str, tuple[int, ...] | None]:
    val = n.meta.get("val")
    return str(n.target), tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _outliers(pieces: list[_Piece], codes: list[str]) -> list[tuple[_Key, _Key]]:
    """Each instance piece whose code is not the one at least two of its siblings (same phase and module
    family) share, with one of those siblings."""
    families: dict[tuple[str, str], list[tuple[_Key, str]]] = {}
    for p, c in zip(pieces, codes):
        if p.key is not None:
            families.setdefault((p.key[0], _family(p.key[1])), []).append((p.key, c))
    out: list[tuple[_Key, _Key]] = []
    for members in families.values():
        shared, count = Counter(c for _, c in members).most_common(1)[0]
        if count >= 2:
            sibling = next(k for k, c in members if c == shared)
            out += [(k, sibling) for k, c in members if c != shared]
    return out


def _hoisted(
    groups: list[tuple[_Key, list[fx.Node]]], key: _Key, sibling: _Key
) -> tuple[list[tuple[_Key, list[fx.Node]]], int] | None:
    """``groups`` with the nodes of ``key``'s group that ``sibling``'s lacks moved into the glue before it,
    and the number moved; None when its nodes (op and shape, in order) do not contain the sibling's, or a
    node to move reads one that stays."""
    at = [i for i, (k, _) in enumerate(groups) if k == key]
    if len(at) != 1:
        return None
    i = at[0]
    mine = groups[i][1]
    theirs = next(nodes for k, nodes in groups if k == sibling)
    if len(mine) <= len(theirs):
        return None
    matcher = difflib.SequenceMatcher(
        None, [_node_key(n) for n in mine], [_node_key(n) for n in theirs], autojunk=False
    )
    blocks = matcher.get_matching_blocks()
    if sum(b.size for b in blocks) != len(theirs):
        return None
    kept = {k for b in blocks for k in range(b.a, b.a + b.size)}
    moved = [n for k, n in enumerate(mine) if k not in kept]
    moving, own = set(moved), set(mine)
    for n in mine:
        if n in moving and any(a in own and a not in moving for a in n.all_input_nodes):
            return None  # it needs a node that stays
        parent = n.args[0] if n.target is operator.getitem else None
        if parent in own and (n in moving) != (parent in moving):
            return None  # tuples never cross pieces
    rest = [n for n in mine if n not in moving]
    regrouped = list(groups)
    if i > 0 and regrouped[i - 1][0] is None:  # into the glue piece already there
        regrouped[i - 1 : i + 1] = [(None, regrouped[i - 1][1] + moved), (key, rest)]
    else:
        regrouped[i : i + 1] = [(None, moved), (key, rest)]
    return regrouped, len(moved)


def _codes(pieces: list[_Piece]) -> tuple[list[str], list[list[Any]], list[tuple[bool, ...]]]:
    """Each piece's code key (equal keys: one compile), its lifted integer constants, and which of its
    liftable constants are lifted (those that differ between pieces of the same code)."""
    raw = [_signature(p) for p in pieces]
    groups: dict[str, list[int]] = {}
    for i, (sig, _) in enumerate(raw):
        groups.setdefault(sig, []).append(i)
    lift: list[tuple[bool, ...]] = [()] * len(pieces)
    lifted: list[list[Any]] = [[] for _ in pieces]
    for members in groups.values():
        values = [raw[i][1] for i in members]
        mask = tuple(len({v[j] for v in values}) > 1 for j in range(len(values[0])))
        for i in members:
            lift[i] = mask
            lifted[i] = [v for v, m in zip(raw[i][1], mask) if m]
    return [raw[i][0] + repr(lift[i]) for i in range(len(pieces))], lifted, lift


def _view_nodes(node: fx.Node) -> list[fx.Node]:
    """The nodes that make ``node`` from its base (the multi-output view op behind a getitem too)."""
    out = []
    for n in alias_chain(node)[:-1]:
        out.append(n)
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            out.append(n.args[0])
    return out


def _placeholders_first(graph: fx.Graph) -> None:
    """Move the lifted constants' placeholders (made where their reader is) up with the others."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = next(n for n in graph.nodes if n.op != "placeholder")
    for n in placeholders:
        anchor.prepend(n)
    graph.lint()


def _liftable(n: fx.Node) -> bool:
    if n.target not in _LIFTABLE or len(n.args) != 2 or n.kwargs:
        return False
    lit, x = n.args[1], n.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (
        type(lit) is int
        and isinstance(val, torch.Tensor)
        and not val.dtype.is_floating_point
        and not val.dtype.is_complex
        and val.dtype is not torch.bool
    )


def _signature(p: _Piece) -> tuple[str, list[Any]]:
    """The piece's code with liftable integer constants abstracted, and those constants in order."""
    local = {n: k for k, n in enumerate(p.nodes)}
    inputs = {a: j for j, a in enumerate(p.inputs)}
    values: list[Any] = []

    def ref(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return f"%{local[a]}" if a in local else f"x{inputs[a]}"
        if isinstance(a, (list, tuple)):
            return type(a)(ref(x) for x in a)
        if isinstance(a, dict):
            return {k: ref(v) for k, v in a.items()}
        return a

    lines = []
    for n in p.nodes:
        args = list(n.args)
        if _liftable(n):
            values.append(args[1])
            args[1] = "<int>"
        lines.append(f"{n.target}({ref(args)!r}, {ref(dict(n.kwargs))!r})")
    metas = [_meta(a) for a in p.inputs]
    outs = [local[o] for o in p.outputs]
    copies = [(inputs[d], ref(s)) for d, s in p.copies]
    return "\n".join(lines) + f"\n{metas}\n{outs}\n{copies}", values


def _meta(a: fx.Node) -> tuple[Any, ...]:
    val = a.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return ("?", type(val).__name__)
    return (tuple(val.shape), tuple(val.stride()), str(val.dtype))


def _unsupported(
    graph: fx.Graph, flat: list[Any], num_state: int, placeholders: list[fx.Node], body: list[fx.Node]
) -> str | None:
    """Why the step cannot be split (None: it can)."""
    attr = next((n for n in graph.nodes if n.op == "get_attr"), None)
    if attr is not None:  # INV-1: a StepGraph holds no constants as attributes
        return f"node %{attr.name} reads a module attribute (get_attr); the pieces take only inputs"
    state = set(placeholders[:num_state])
    for i, new in enumerate(flat[:num_state]):
        if not isinstance(new, fx.Node):
            return f"state {i}'s new value is not computed by the graph"
        if new.op == "placeholder" and new is not placeholders[i]:
            return f"state {i}'s new value is another input (a swap)"
        if new.op != "placeholder" and alias_chain(new)[-1] in state:
            return f"state {i}'s new value is a view of a state input"
    for v in flat[num_state:]:
        if not isinstance(v, fx.Node):
            return "an output is not a graph value"
        if alias_chain(v)[-1].op == "placeholder":
            return "an output is (a view of) an input"
    for n in body:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and val):
            continue
        if n.users:
            return f"node %{n.name} has no example value (meta['val'])"
    return None


REGION_EVENT = "recir.region "  # the profiler event of a piece: this, then "<scope> <phase>"


@dataclasses.dataclass(frozen=True)
class PieceRegion:
    """What a compiled piece computes: a repeated module instance (``layers.3``) in one phase, or glue
    (``(glue)``: the nodes between them, of one or more phases joined by ``+``), and its node count."""

    scope: str
    phase: str
    nodes: int

    @property
    def event(self) -> str:
        return f"{REGION_EVENT}{self.scope} {self.phase}"


def piece_region(piece: _Piece) -> PieceRegion:
    if piece.key is not None:
        phase, scope = piece.key
    else:
        phases = dict.fromkeys(str(n.meta.get(PHASE_KEY, "-")) for n in piece.nodes)
        scope, phase = "(glue)", "+".join(phases)
    return PieceRegion(scope, phase, len(piece.nodes))


class RegionsFn:
    """Runs the compiled pieces in order over ``(*state, *batch)``, freeing each value after its last
    reader; returns the step's user outputs (state is updated in place)."""

    def __init__(
        self,
        num_args: int,
        calls: list[tuple[Callable[..., Any], list[int], list[torch.Tensor], list[int], list[int]]],
        outputs: list[int],
        strides: dict[int, tuple[int, ...]] | None = None,
        regions: Sequence[PieceRegion] = (),
    ) -> None:
        """``strides``: value slot -> the layout (strides) the pieces reading it were compiled for;
        ``regions``: each call's region (its profiler event names it)."""
        self._num_args = num_args
        self._calls = calls
        self._outputs = outputs
        self._size = num_args + sum(len(c[3]) for c in calls)
        self._strides = strides or {}
        self.regions = list(regions)
        self._events = [r.event for r in self.regions] if len(self.regions) == len(calls) else []

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        env: list[Any] = [*args, *([None] * (self._size - self._num_args))]
        profiling = bool(self._events) and torch.autograd._profiler_enabled()
        for k, (fn, ins, lifted, outs, frees) in enumerate(self._calls):
            if profiling:  # one event per piece: --profile's time per region
                with torch.profiler.record_function(self._events[k]):
                    result = fn(*[env[i] for i in ins], *lifted)
            else:
                result = fn(*[env[i] for i in ins], *lifted)
            for slot, value in zip(outs, result):
                want = self._strides.get(slot)
                if want is not None and isinstance(value, torch.Tensor) and value.stride() != want:
                    # Inductor may return an output in another layout than the traced graph's (measured: a
                    # weight gradient oneDNN computed transposed); the pieces reading it were compiled for
                    # the traced layout and assert it.
                    value = torch.empty_strided(
                        value.shape, want, dtype=value.dtype, device=value.device
                    ).copy_(value)
                env[slot] = value
            for slot in frees:
                env[slot] = None
        return [env[i] for i in self._outputs]


def compile_regions(
    split: RegionSplit,
    example_inputs: list[torch.Tensor],
    device: torch.device,
    compile_piece: Callable[[fx.GraphModule, list[torch.Tensor]], Callable[..., Any]],
    fake: Callable[[Sequence[int], Sequence[int], torch.dtype], torch.Tensor],
) -> tuple[RegionsFn, dict[str, int]]:
    """The pieces of ``split`` (one that has no ``reason``), each distinct code compiled once by
    ``compile_piece(gm, fake_inputs)``, as one callable over the step's inputs."""
    assert split.reason is None, split.reason
    codes, lifted = split.codes, split.lifted
    slot: dict[fx.Node, int] = {ph: i for i, ph in enumerate(split.placeholders)}
    arg_example = dict(zip(split.placeholders, example_inputs))
    compiled: dict[str, Callable[..., Any]] = {}
    raw_calls = []
    expected_strides: dict[int, tuple[int, ...]] = {}
    nxt = len(split.placeholders)
    for i, p in enumerate(split.pieces):
        code = codes[i]
        dtypes = split.lift_dtypes[i]
        if code not in compiled:
            examples = [
                arg_example[a]
                if a in arg_example
                else fake(a.meta["val"].shape, a.meta["val"].stride(), a.meta["val"].dtype)
                for a in p.inputs
            ]
            examples += [fake((), (), d) for d in dtypes]
            piece = split.graph_module(i)
            compiled[code] = compile_piece(piece, examples)
        consts = [torch.tensor(v, dtype=d, device=device) for v, d in zip(lifted[i], dtypes)]
        outs = []
        for o in p.outputs:
            val = o.meta.get("val")
            if isinstance(val, torch.Tensor):
                expected_strides[nxt] = tuple(val.stride())
            slot[o] = nxt
            outs.append(nxt)
            nxt += 1
        raw_calls.append((compiled[code], [slot[a] for a in p.inputs], consts, outs))
    last_use: dict[int, int] = {}
    for i, (_, ins, _, _) in enumerate(raw_calls):
        for s in ins:
            last_use[s] = i
    final = {slot[v] for v in split.final}
    frees: list[list[int]] = [[] for _ in raw_calls]
    for s, i in last_use.items():
        if s >= len(split.placeholders) and s not in final:
            frees[i].append(s)
    calls = [(fn, ins, consts, outs, frees[i]) for i, (fn, ins, consts, outs) in enumerate(raw_calls)]
    outputs = [slot[v] for v in split.user_outputs]
    stats = {"pieces": len(split.pieces), "compiled": len(compiled)}
    regions = [piece_region(p) for p in split.pieces]
    return RegionsFn(len(split.placeholders), calls, outputs, expected_strides, regions), stats


def _lift_nodes(p: _Piece) -> list[fx.Node]:
    return [n for n in p.nodes if _liftable(n)]
