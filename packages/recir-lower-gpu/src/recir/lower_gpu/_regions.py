"""Compile each repeated module region once (``GPUOptions(regions="repeated")``).

recir.transforms' ``RegionSplit`` cuts the step into pieces (one per repeated module instance and phase,
and the glue between them); here pieces of the same code become one GraphModule whose differing integer
constants are 0-d tensor inputs, and each distinct piece is compiled once by Inductor. The pieces run in
order, each value freed after its last reader. Each new state value is written into its input
(``copy_``) by the piece that computes it, or by the last piece that reads the old value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import PHASE_KEY
from recir.transforms._repeated import Piece, RegionSplit

__all__ = ["REGION_EVENT", "PieceRegion", "RegionSplit", "RegionsFn", "compile_regions", "piece_region"]


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


def piece_region(piece: Piece) -> PieceRegion:
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
