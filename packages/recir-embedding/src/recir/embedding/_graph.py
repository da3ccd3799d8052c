"""Small fx helpers for embedding rewrites: trace a function on a node's FakeTensor values and splice it in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import PHASE_KEY, PROVENANCE_KEY
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx


def splice(
    graph: fx.Graph,
    fn: Callable[..., Any],
    args: Sequence[fx.Node],
    *,
    before: fx.Node,
    phase: str,
    provenance: str,
) -> list[fx.Node]:
    """Trace ``fn`` on the FakeTensor ``val`` of ``args`` and insert its nodes before ``before``.

    Returns the nodes of ``fn``'s (flat) outputs. New nodes get ``val``, ``recir.phase`` and provenance.
    """
    vals = [a.meta["val"] for a in args]
    fake_mode = detect_fake_mode(vals)
    with fake_mode if fake_mode is not None else torch._subclasses.FakeTensorMode():
        sub = make_fx(lambda *xs: tuple(fn(*xs)), tracing_mode="real")(*vals)
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    for ph, a in zip(placeholders, args):
        env[ph] = a
    out: list[fx.Node] = []
    with graph.inserting_before(before):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = [env[x] for x in n.args[0]]
                break
            if n.op == "get_attr":
                raise RuntimeError(
                    f"splice: {fn} created a tensor constant ({n.target}); build it from inputs"
                )
            new = graph.node_copy(n, lambda x: env[x])
            new.meta[PHASE_KEY] = phase
            new.meta[PROVENANCE_KEY] = [*new.meta.get(PROVENANCE_KEY, []), provenance]
            env[n] = new
    return out
