"""``TPUOptions(regions="repeated")``: each run of identical layers traced once, as a ``jax.lax.scan``.

XLA compiles every copy of a model's N identical layers (five STU layers in DLRMv3: forward and
backward), and on a TPU that compile is most of a step's start-up (100-250 s at full size on a v5e).
Here recir.transforms' ``RegionSplit`` cuts the step at its repeated module instances; each run of
consecutive pieces with the same code in the forward or backward phase (``layers.0 .. layers.3``
forward; ``layers.3 .. layers.0`` backward) is traced once as the body of a ``lax.scan``, so XLA compiles
one layer where it compiled four. Each input of the run's pieces is one of:

- a carry: piece k reads what piece k-1 returned at one output position (the hidden state);
- invariant: every piece reads the same value (the batch's offsets, the step's key);
- per layer (``xs``): stacked along a new leading axis (the layer's weights, its saved activations).
  A stack the step already has (an earlier scan's outputs, e.g. the forward's saved activations read
  by the backward in reverse order, or the same weights stacked for the forward) is reused, and the scan
  runs in reverse when that reuses more of them;
- a lifted integer constant (a layer's dropout counter base): ``xs`` as well.

The pieces' outputs read after the run come back stacked (``ys``); each reader takes its layer's slice.
The values are the same as the whole step's: the same ops on the same operands, with the layer loop
left to XLA. The optimizer's per-layer pieces stay unrolled (stacking every layer's weights and moments
costs a copy of them each step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import torch
import torch.fx as fx
from recir.transforms import RegionSplit

from ._registry import jax_lowering_for

logger = logging.getLogger("recir.lower_tpu")

#: the phases whose repeated pieces become scans
SCAN_PHASES = ("forward", "backward")


def _lift_ops() -> tuple[Any, ...]:
    op = getattr(getattr(torch.ops, "recir", None), "counter_uniform", None)
    return (op.default,) if op is not None and hasattr(op, "default") else ()


@dataclasses.dataclass
class ScanRun:
    """Consecutive pieces of one code, run as one ``lax.scan`` (positions index the pieces' inputs and
    outputs lists, the same for every piece of the run)."""

    pieces: list[int]
    carry: list[tuple[int, int]]  # (input position, the previous piece's output position)
    invariant: list[int]
    xs: list[int]
    ys: list[int]  # output positions read after the run
    reverse: bool = False


class ScanPlan:
    """The step's nodes in RegionSplit's order, with its runs of repeated pieces as ``ScanRun``s."""

    def __init__(self, gm: fx.GraphModule, num_state: int) -> None:
        self.split = split = RegionSplit(gm, num_state, lift_ops=_lift_ops())
        self.runs: list[ScanRun] = []
        self.reason = split.reason
        self.items: list[fx.Node | ScanRun] = []
        if split.reason is not None:
            return
        pieces = split.pieces
        runs: list[list[int]] = []
        for i, p in enumerate(pieces):
            scannable = p.key is not None and p.key[0] in SCAN_PHASES and not p.copies
            if scannable and runs and runs[-1][-1] == i - 1 and split.codes[i] == split.codes[runs[-1][-1]]:
                runs[-1].append(i)
            elif scannable:
                runs.append([i])
        final = set(split.final)
        planned = {}
        for members in runs:
            if len(members) < 2:
                continue
            run = _classify(split, members, final)
            if run is not None:
                planned[members[0]] = run
                self.runs.append(run)
        skip: set[int] = set()
        for i, p in enumerate(pieces):
            if i in planned:
                self.items.append(planned[i])
                skip.update(planned[i].pieces)
            elif i not in skip:
                self.items.extend(p.nodes)
        if not self.runs:
            self.reason = "no run of two or more identical layer pieces in the forward or backward"

    def describe(self) -> str:
        layers = sum(len(r.pieces) for r in self.runs)
        return f"{len(self.runs)} scan(s) over {layers} layer piece(s)"


def _classify(split: RegionSplit, members: list[int], final: set[fx.Node]) -> ScanRun | None:
    """The run's carries, invariants, per-layer inputs and stacked outputs; None when a per-layer input
    of one piece is computed by another piece of the run (it would need the scan's own outputs)."""
    pieces = [split.pieces[i] for i in members]
    inside = {n for p in pieces for n in p.nodes}
    carry: list[tuple[int, int]] = []
    invariant: list[int] = []
    xs: list[int] = []
    for pos in range(len(pieces[0].inputs)):
        values = [p.inputs[pos] for p in pieces]
        links = {prev.outputs.index(v) if v in prev.outputs else -1 for prev, v in zip(pieces, values[1:])}
        if len(links) == 1 and (q := links.pop()) >= 0:
            carry.append((pos, q))
        elif all(v is values[0] for v in values):
            invariant.append(pos)
        elif any(v in inside for v in values):
            return None
        else:
            xs.append(pos)
    carried = {q for _, q in carry}
    ys = [
        q
        for q in range(len(pieces[0].outputs))
        if any(_read_outside(p.outputs[q], inside, final) for p in pieces)
        or (q not in carried and any(p.outputs[q] in final for p in pieces))
    ]
    # A carried output read only by the next piece needs no stack; the last piece's is the final carry.
    return ScanRun(list(members), carry, invariant, xs, ys)


def _read_outside(node: fx.Node, inside: set[fx.Node], final: set[fx.Node]) -> bool:
    return node in final or any(u not in inside for u in node.users)


class ScanTracer:
    """Runs the plan's items on torchax tensors: plain nodes through ``tracer.run_node``, runs as scans."""

    def __init__(self, plan: ScanPlan, tracer: Any, new_tracer: Callable[[], Any]) -> None:
        self.plan = plan
        self.tracer = tracer  # a recir.lower_tpu._trace._JaxTracer over the step's graph
        self.new_tracer = new_tracer
        self.tx = tracer.tx_env
        self._stacks: dict[tuple[fx.Node, ...], jax.Array] = {}
        self._slices: dict[fx.Node, tuple[jax.Array, int]] = {}

    def run(self, *args: Any) -> Any:
        env = self.tracer.env = {}
        graph = self.plan.split.placeholders[0].graph
        for ph, a in zip(self.plan.split.placeholders, args):
            env[ph] = a
        for item in self.plan.items:
            if isinstance(item, ScanRun):
                self._scan(item)
            else:
                env[item] = self.tracer.run_node(item)
        out = graph.output_node().args[0]
        return fx.node.map_arg(out, lambda n: env[n])

    # -- one run --------------------------------------------------------------------------------------
    def _scan(self, run: ScanRun) -> None:
        split, env, tx = self.plan.split, self.tracer.env, self.tx
        pieces = [split.pieces[i] for i in run.pieces]
        m = len(pieces)
        run.reverse = self._reuses(pieces, run, True) > self._reuses(pieces, run, False)
        xs = [self._stack([p.inputs[pos] for p in pieces], run.reverse) for pos in run.xs]
        consts = [
            jnp.asarray(
                [split.lifted[i][j] for i in (reversed(run.pieces) if run.reverse else run.pieces)],
                dtype=_jax_int(split.lift_dtypes[run.pieces[0]][j]),
            )
            for j in range(len(split.lifted[run.pieces[0]]))
        ]
        first = pieces[0]
        init = tuple(tx.t2j_iso(env[first.inputs[pos]]) for pos, _ in run.carry)
        template = run.pieces[0]
        body = self._body(template, run)
        with jax.named_scope(f"scan {first.key[1] if first.key else ''} x{m}"):
            last, ys = jax.lax.scan(body, init, (tuple(xs), tuple(consts)), reverse=run.reverse)
        for k, p in enumerate(pieces):
            t = m - 1 - k if run.reverse else k
            for q, stacked in zip(run.ys, ys):
                node = p.outputs[q]
                env[node] = tx.j2t_iso(stacked[t])
                self._slices[node] = (stacked, t)
        lastp = pieces[-1]
        for (_, q), value in zip(run.carry, last):
            if q not in run.ys:
                env[lastp.outputs[q]] = tx.j2t_iso(value)

    def _body(self, template: int, run: ScanRun) -> Callable[..., Any]:
        split, tx, outer = self.plan.split, self.tx, self.tracer.env
        piece = split.pieces[template]
        lifted_nodes = [n for n, on in zip(_lift_nodes(split, piece), split.lift[template]) if on]

        def body(carry: tuple[Any, ...], x: tuple[tuple[Any, ...], tuple[Any, ...]]) -> Any:
            xs, consts = x
            sub = self.new_tracer()
            env = sub.env = {}
            for (pos, _), v in zip(run.carry, carry):
                env[piece.inputs[pos]] = tx.j2t_iso(v)
            for pos in run.invariant:
                env[piece.inputs[pos]] = outer[piece.inputs[pos]]
            for pos, v in zip(run.xs, xs):
                env[piece.inputs[pos]] = tx.j2t_iso(v)
            lifted = dict(zip(lifted_nodes, consts))
            for n in piece.nodes:
                env[n] = _run_lifted(sub, n, lifted[n]) if n in lifted else sub.run_node(n)
            new = tuple(tx.t2j_iso(env[piece.outputs[q]]) for _, q in run.carry)
            ys = tuple(tx.t2j_iso(env[piece.outputs[q]]) for q in run.ys)
            return new, ys

        return body

    # -- stacks ---------------------------------------------------------------------------------------
    def _reuses(self, pieces: Sequence[Any], run: ScanRun, reverse: bool) -> int:
        count = 0
        for pos in run.xs:
            nodes = [p.inputs[pos] for p in pieces]
            order = tuple(reversed(nodes)) if reverse else tuple(nodes)
            count += order in self._stacks or self._whole_stack(order) is not None
        return count

    def _whole_stack(self, order: tuple[fx.Node, ...]) -> jax.Array | None:
        """An earlier scan's stacked output that is exactly ``order``'s values, in order."""
        found = [self._slices.get(n) for n in order]
        if any(f is None for f in found):
            return None
        arrays = {id(f[0]) for f in found if f is not None}
        if len(arrays) != 1:
            return None
        stacked = found[0][0]  # type: ignore[index]
        if stacked.shape[0] != len(order) or [f[1] for f in found] != list(range(len(order))):  # type: ignore[index]
            return None
        return stacked

    def _stack(self, nodes: list[fx.Node], reverse: bool) -> jax.Array:
        order = tuple(reversed(nodes)) if reverse else tuple(nodes)
        if order in self._stacks:
            return self._stacks[order]
        whole = self._whole_stack(order)
        if whole is None:
            whole = jnp.stack([self.tx.t2j_iso(self.tracer.env[n]) for n in order])
        self._stacks[order] = whole
        return whole


def _lift_nodes(split: RegionSplit, piece: Any) -> list[fx.Node]:
    from recir.transforms._repeated import lift_nodes

    return lift_nodes(piece, split.lift_ops)


def _jax_int(dtype: torch.dtype) -> Any:
    return {torch.int64: jnp.int64, torch.int32: jnp.int32, torch.int16: jnp.int16, torch.int8: jnp.int8}.get(
        dtype, jnp.int64
    )


def _run_lifted(tracer: Any, node: fx.Node, const: Any) -> Any:
    """``node`` with its lifted integer argument 1 given as the scan's 0-d value ``const``."""
    tx = tracer.tx_env
    args, kwargs = tracer.fetch_args_kwargs_from_env(node)
    with jax.named_scope(node.name):
        lowering = jax_lowering_for(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
        if lowering is not None and node.target.namespace != "aten":
            jargs, jkwargs = tx.t2j_iso((args, kwargs))
            jargs = (jargs[0], const, *jargs[2:])
            return tx.j2t_iso(lowering(*jargs, **jkwargs))
        a0 = tx.t2j_iso(args[0])
        out = {
            torch.ops.aten.add.Tensor: jnp.add,
            torch.ops.aten.sub.Tensor: jnp.subtract,
            torch.ops.aten.mul.Tensor: jnp.multiply,
        }[node.target](a0, const.astype(a0.dtype))
        return tx.j2t_iso(out)
