"""cached_history: a serving graph split into a history graph (once per user) and a candidate graph.

Under the target-aware mask of ``recir::hstu_attention`` no history slot sees a candidate, so a
history token's keys and values, in every layer, do not depend on the candidates. From a serving
StepGraph (``to_inference``) whose attention is the op in every layer:

1. ``recir-split-candidate-attention`` (a RegionTransform on each op whose sequence has candidate
   slots) replaces it by the op on the history slots alone plus the candidates' attention against
   the history's keys and values (zeroed where padded: SiLU(0) = 0) and their own, concatenated;
   the history's keys and values pass a ``recir::history_cache`` marker.
2. ``recir-cleanup-narrow`` with ``split``: every value along the token axis (projections, norms,
   MLPs, embedding lookups) computed as its history rows and its candidate rows apart.
3. The history graph computes the markers' values (the cache); the candidate graph reads them as
   batch inputs instead, so it holds no history-row work and no attention among history tokens.

Exact: the candidates' rows are the same sums as the full sequence's (each candidate sees the valid
history and itself), up to summation order. The attention normaliser (``scale``) is computed by both
graphs from the batch; a server pins it per user (as DLRMv3's ``max_seq_len``), since one that grew
with the candidate count would make the history depend on the candidates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor

from ._errors import ConfigError
from ._graph_util import node_val
from ._hstu import hstu_attention
from ._override import register_override_op
from ._region import Region, RegionTransform
from ._signature import BatchSlot, OutputSlot, Signature
from ._step import StepGraph
from ._transform import register_transform

CACHED_HISTORY_KEY = "recir.cached_history"
_SPLIT = "recir-split-candidate-attention"
_HSTU = torch.ops.recir.hstu_attention.default


@torch.library.custom_op("recir::history_cache", mutates_args=())
def history_cache(x: Tensor, layer: int, kind: str) -> Tensor:
    """Identity marker of one cache value (``kind`` "keys" or "values" of attention ``layer``): what
    ``cached_history`` cuts the graph at. Never left in a graph it returns."""
    return x.clone()


@history_cache.register_fake
def _history_cache_fake(x, layer, kind):
    return torch.empty_like(x)


# An opaque op in the split graph between the two transforms, so it must pass INV-6 like any override.
register_override_op("recir::history_cache", _SPLIT)


def candidate_attention(
    q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor, scale: Tensor, alpha: float
) -> Tensor:
    """Candidates' rows of ``recir::hstu_attention``: q, k, v [B, H, C, A] against the history's
    ``keys``/``values`` [B, H, P, A] (padded rows zeroed) and each candidate itself, none against
    another. Padded candidates are zeroed by the caller."""
    scores = F.silu(alpha * (q @ keys.transpose(-1, -2))) / scale
    own = F.silu(alpha * (q * k).sum(dim=-1, keepdim=True)) / scale
    return scores @ values + own * v


def _prefix_bounds(bounds: list[int], prefix: int) -> list[int]:
    """The op's query row blocks clipped to the history's slots."""
    return sorted({min(b, prefix) for b in bounds})


@register_transform
class SplitCandidateAttention(RegionTransform):
    """Each ``recir::hstu_attention`` with candidate slots (``prefix`` < N) as the op on the history
    slots, concatenated with the candidates' attention against the history's keys and values, which
    pass ``recir::history_cache`` markers (see ``cached_history``)."""

    name = _SPLIT
    summary = "hstu_attention as history attention + candidates against the history's keys and values"

    def match(self, step: StepGraph) -> list[Region]:
        ops = [n for n in step.graph.nodes if n.target is _HSTU and n.args[5] < node_val(n).shape[2]]
        return [Region(step, [n], f"{self.name}:{i}") for i, n in enumerate(ops)]

    def rewrite(self, step: StepGraph, region: Region) -> bool:
        (node,) = region.nodes
        _q, _k, _v, _valid, _scale, p, alpha, bounds = node.args
        layer = int(region.name.rsplit(":", 1)[1])
        prefix_bounds = _prefix_bounds(list(bounds), p)  # type: ignore[arg-type]

        def split(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: Tensor) -> Tensor:
            keep = valid[:, None, :, None].to(q.dtype)
            keys = history_cache(k[:, :, :p] * keep[:, :, :p], layer, "keys")
            values = history_cache(v[:, :, :p] * keep[:, :, :p], layer, "values")
            history = hstu_attention(
                q[:, :, :p], k[:, :, :p], v[:, :, :p], valid[:, :p], scale, p, alpha, prefix_bounds
            )
            cand = candidate_attention(q[:, :, p:], k[:, :, p:], v[:, :, p:], keys, values, scale, alpha)
            return torch.cat([history, cand * keep[:, :, p:]], dim=2)

        region.replace(split, provenance=self.name)
        return True


@dataclass(frozen=True)
class CachedHistory:
    """The two graphs of cached-history serving. ``history``: the serving graph's state and batch ->
    the cache (outputs ``cache.<layer>.keys`` / ``.values``, [B, H, P, A] each, in ``cache`` order).
    ``candidates``: its state and batch ``(serving batch, (cache...))`` -> the serving graph's output.
    Together they equal the serving graph (up to summation order)."""

    history: StepGraph
    candidates: StepGraph
    cache: tuple[str, ...]


def cached_history(serving: StepGraph) -> CachedHistory:
    """Split ``serving`` (not modified; a ``to_inference`` graph whose attention is
    ``recir::hstu_attention`` in every layer) into its history and candidate graphs (module docstring).

    Raises ``ConfigError`` when the graph has no such op with candidate slots, or when the candidate
    graph would still compute history rows (a value along the token axis that ``recir-cleanup-narrow``
    cannot split: the error names it)."""
    from ._transforms.narrow import Narrow

    step = serving.copy()
    split = SplitCandidateAttention().run(step)
    if not split.stats["rewritten"]:
        raise ConfigError(
            "cached_history: the serving graph has no recir::hstu_attention with candidate slots (prefix < N). "
            "Fix: capture the model with its attention as the op in every layer (DLRMv3: "
            "model.recompute_attention_scores() and model.candidates_only_last_layer = False)"
        )
    narrowed = Narrow(split=True).run(step).stats
    markers = [n for n in step.graph.nodes if n.target is torch.ops.recir.history_cache.default]
    markers.sort(key=lambda n: (n.args[1], n.args[2] != "keys"))
    names = tuple(f"cache.{n.args[1]}.{n.args[2]}" for n in markers)
    if len(set(names)) != len(names):
        raise ConfigError(f"cached_history: a cache value was split in two ({sorted(names)})")
    history = _history_graph(step, markers, names)
    candidates = _candidate_graph(step, markers, names)
    report = {
        "layers": split.stats["rewritten"],
        "cache": list(names),
        "split": narrowed.get("split", 0),
        "history_nodes": _compute_nodes(history),
        "candidate_nodes": _compute_nodes(candidates),
        "serving_nodes": _compute_nodes(serving),
    }
    for g in (history, candidates):
        g.meta[CACHED_HISTORY_KEY] = report
    return CachedHistory(history, candidates, names)


def _compute_nodes(step: StepGraph) -> int:
    return sum(n.op == "call_function" for n in step.graph.nodes)


def _strip(graph: fx.Graph) -> None:
    for n in list(graph.nodes):
        if n.target is torch.ops.recir.history_cache.default:
            n.replace_all_uses_with(n.args[0])  # type: ignore[arg-type]
            graph.erase_node(n)


def _drop_unused_state(step: StepGraph, graph: fx.Graph) -> tuple[Any, ...]:
    """Erase the state slots nothing but the output reads (placeholder and its new-state output);
    returns the kept state slots. The output is ``new_state + outputs`` of ``step``'s state."""
    n_state = len(step.signature.state)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][:n_state]
    out_node = graph.output_node()
    kept = [i for i in range(n_state) if any(u.op != "output" for u in placeholders[i].users)]
    values = list(out_node.args[0])  # type: ignore[arg-type]
    out_node.args = (tuple(v for j, v in enumerate(values) if j >= n_state or j in kept),)
    for i in reversed(range(n_state)):
        if i not in kept:
            graph.erase_node(placeholders[i])
    return tuple(step.signature.state[i] for i in kept)


def _history_graph(step: StepGraph, markers: list[fx.Node], names: tuple[str, ...]) -> StepGraph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(step.graph, env)  # the serving output: new state, then the user output
    n_state = len(step.signature.state)
    cache = []
    for m in markers:  # row-major: a caller (an AOTInductor package) may take its inputs as dense
        with graph.inserting_after(env[m]):
            dense = graph.call_function(
                torch.ops.aten.clone.default, (env[m],), {"memory_format": torch.contiguous_format}
            )
        dense.meta = {**env[m].meta, "val": node_val(m).clone(memory_format=torch.contiguous_format)}
        cache.append(dense)
    graph.output((*out[:n_state], *cache))  # type: ignore[index]
    graph.eliminate_dead_code()
    _strip(graph)
    state = _drop_unused_state(step, graph)
    outputs = tuple(
        OutputSlot(name, tuple(node_val(m).shape), node_val(m).dtype) for name, m in zip(names, markers)
    )
    sig = step.signature
    signature = Signature(state=state, batch=sig.batch, outputs=outputs, batch_spec=sig.batch_spec)
    gm = fx.GraphModule(step.graph_module, graph)
    return step.replace(graph_module=gm, signature=signature)


def _candidate_graph(step: StepGraph, markers: list[fx.Node], names: tuple[str, ...]) -> StepGraph:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(step.graph, env)
    graph.output(out)
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    slots: list[BatchSlot] = []
    with graph.inserting_after(last):
        for name, m in reversed(list(zip(names, markers))):  # inserted after `last`: reversed keeps the order
            ph = graph.placeholder(name.replace(".", "_"))
            ph.meta["val"] = node_val(m).clone(memory_format=torch.contiguous_format)  # as history returns it
            env[m].replace_all_uses_with(ph)
            slots.insert(0, BatchSlot(name, tuple(node_val(m).shape), node_val(m).dtype, "dense"))
    graph.eliminate_dead_code()
    left = [n for n in graph.nodes if n.target in (_HSTU, torch.ops.recir.history_cache.default)]
    if left:
        raise ConfigError(
            f"cached_history: the candidate graph still computes the history's attention (%{left[0].name}): "
            "a value along the token axis feeds both the history's rows and the candidates' and "
            "recir-cleanup-narrow could not split it. Fix: report the graph (step.format_graph()); a "
            "reshape or op it has no rule for mixes the two"
        )
    state = _drop_unused_state(step, graph)
    sig = step.signature
    spec = None
    if sig.batch_spec is not None:
        cache_spec = pytree.tree_structure(tuple(0 for _ in slots))
        spec = pytree.TreeSpec(tuple, None, [sig.batch_spec, cache_spec])  # (serving batch, cache)
    signature = Signature(state=state, batch=(*sig.batch, *slots), outputs=sig.outputs, batch_spec=spec)
    gm = fx.GraphModule(step.graph_module, graph)
    return step.replace(graph_module=gm, signature=signature)
