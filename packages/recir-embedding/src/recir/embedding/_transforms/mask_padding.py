"""``recir-embed-mask-padding``: padded positions of a jagged id feature do no work that reaches the outputs.

A batch padded to a static bucket carries, per jagged feature, ``ids`` of the bucket's size (real ids
first, then padding that repeats a real id, as ``pad_to_bucket`` writes it) and the samples' ``lengths``
(their sum is the number of real ids). The transform marks the jagged dimension from the batch spec (the
ids slot and its lengths slot: ``recir.jagged`` on the ids placeholder and on every lookup of it) and
rewrites each unpooled lookup of such ids so its padded rows are zeros, in the forward and in the table's
gradient::

    %rows = recir.embedding(%T, %ids)                  %rows = recir.embedding(%T, %ids)
    %h = aten.sum.dim_IntList(%rows, [0])       ->     %valid = lt(arange(N), sum(%lengths))      # [N]
    ...                                                %rows_m = mul(%rows, unsqueeze(to(%valid), 1))
    %gT = index_add(%zeros, 0, %ids, %per_id)           %h = aten.sum.dim_IntList(%rows_m, [0])
                                                       %gT = index_add(%zeros, 0, %ids, mul(%per_id, %m))

so every reduction over the jagged dimension (a sum, a matrix product) sees only real rows, and the
sparse update writes no padded slot. Pooled lookups (``recir::embedding_bag``) need nothing: their
offsets leave padding out of every bag. The ids may reach the lookup through position-wise maps
(hashing: ``remainder(ids * a + b, rows)``), which keep the positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import (
    PHASE_KEY,
    ConfigError,
    StepGraph,
    Transform,
    TransformResult,
    register_transform,
    splice,
)

aten = torch.ops.aten
#: node metadata: ``{"dim": 0, "lengths": <batch slot>, "ids": <batch slot>}`` on a jagged ids value and its rows
JAGGED_KEY = "recir.jagged"
_ROLE_WORDS = ("ids", "id", "values", "lengths", "length", "lens")


@register_transform
class MaskPadding(Transform):
    """Zero the padded rows of every unpooled lookup of a padded jagged id feature (see the module doc).

    ``lengths`` maps an ids batch slot to its lengths batch slot; by default each ``ids`` slot pairs with
    the one ``lengths`` slot whose name matches once the role words are dropped (``seq_ids`` /
    ``seq_lengths``), or with the only lengths slot. Stats: ``masked`` lookups, ``features`` marked,
    ``skipped`` ids slots with the reason.
    """

    name = "recir-embed-mask-padding"
    summary = "zero padded rows of jagged id lookups (forward and table gradient) from the batch's lengths"

    @dataclasses.dataclass(frozen=True)
    class Options:
        lengths: tuple[tuple[str, str], ...] = ()

        def __post_init__(self) -> None:
            if isinstance(self.lengths, Mapping):
                object.__setattr__(self, "lengths", tuple(sorted(self.lengths.items())))

    def run(self, step: StepGraph) -> TransformResult:
        pairs, skipped = _pairs(step, dict(self.options.lengths), self.name)
        graph = step.graph
        phs = [n for n in graph.nodes if n.op == "placeholder"][len(step.signature.state) :]
        slot_ph = dict(zip([s.name for s in step.signature.batch], phs))
        masked = 0
        for ids_slot, lengths_slot in pairs.items():
            ids_ph, lengths_ph = slot_ph[ids_slot], slot_ph[lengths_slot]
            tag = {"dim": 0, "ids": ids_slot, "lengths": lengths_slot}
            ids_ph.meta[JAGGED_KEY] = tag
            for lookup in _lookups_of(ids_ph):
                lookup.meta[JAGGED_KEY] = tag
                _mask(graph, lookup, lengths_ph, self.name)
                masked += 1
        if masked:
            step.graph_module.recompile()
        stats: dict[str, Any] = {"masked": masked, "features": len(pairs)}
        if skipped:
            stats["skipped"] = skipped
        return TransformResult(step, masked > 0, stats)


def _pairs(step: StepGraph, given: dict[str, str], name: str) -> tuple[dict[str, str], dict[str, str]]:
    batch = {s.name: s for s in step.signature.batch}
    for ids_slot, lengths_slot in given.items():
        for slot, role in ((ids_slot, "ids"), (lengths_slot, "lengths")):
            if slot not in batch:
                raise ConfigError(
                    f"{name}: no batch slot {slot!r} (the {role} of a jagged feature); the batch has "
                    f"{sorted(batch)}. Fix: pass lengths={{ids slot: lengths slot}} with the step's slot names."
                )
    if given:
        return given, {}
    lengths = [s.name for s in batch.values() if s.role == "lengths" and len(s.shape) == 1]
    pairs: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for ids in (s.name for s in batch.values() if s.role == "ids" and len(s.shape) == 1):
        same = [n for n in lengths if _stem(n) == _stem(ids)]
        if len(same) == 1 or len(lengths) == 1:
            pairs[ids] = same[0] if len(same) == 1 else lengths[0]
        else:
            skipped[ids] = f"{len(same) or len(lengths)} candidate lengths slots"
    return pairs, skipped


def _stem(name: str) -> str:
    words = [w for w in name.lower().replace(".", "_").split("_") if w and w not in _ROLE_WORDS]
    return "_".join(words)


def _lookups_of(ids: fx.Node) -> list[fx.Node]:
    """Unpooled lookups whose ids are ``ids`` or a position-wise map of it (same shape, pointwise ops)."""
    out, todo, seen = [], [ids], set()
    n = tuple(ids.meta["val"].shape)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.target is torch.ops.recir.embedding.default and user.args[1] is node:
                out.append(user)
            elif _positionwise(user) and tuple(user.meta["val"].shape) == n:
                todo.append(user)
    return sorted(out, key=lambda x: list(x.graph.nodes).index(x))


def _positionwise(node: fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    return torch.Tag.pointwise in target.tags or target in (aten.clone.default, aten._to_copy.default)


def _valid_rows(rows: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 0/1 column of real positions (``arange(N) < sum(lengths)``) and ``rows`` times it."""
    pos = torch.arange(rows.shape[0], device=rows.device, dtype=lengths.dtype)
    col = (pos < lengths.sum()).to(rows.dtype).unsqueeze(1)
    return col, rows * col


def _mask(graph: fx.Graph, lookup: fx.Node, lengths: fx.Node, name: str) -> None:
    users = list(lookup.users)
    col, masked = splice(
        graph, _valid_rows, [lookup, lengths], before=lookup.next, phase="forward", provenance=name
    )
    for user in users:
        user.replace_input_with(lookup, masked)
    # the table's gradient: zeros.index_add(0, ids, per_id) with this lookup's ids (recir::embedding's backward)
    ids = lookup.args[1]
    for grad in [u for u in ids.users if u.target == aten.index_add.default and u.args[2] is ids]:
        phase = grad.meta.get(PHASE_KEY, "backward")
        (scaled,) = splice(graph, torch.mul, [grad.args[3], col], before=grad, phase=phase, provenance=name)
        grad.update_arg(3, scaled)
