"""Per-node seconds of a compiled step from a JAX profiler trace.

The tracer lowers every StepGraph node under ``jax.named_scope(node.name)``, so each instruction of the
optimised HLO names its node in ``metadata={op_name=".../<node>/..."}``; the trace's XLA events are
named after those instructions (JAX's CPU backend: the bare name, ``fusion.3``; a TPU: the whole
instruction, ``%fusion.3 = f32[16]{0} fusion(...)``). A fusion counts for its root instruction's node.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from recir.transforms import ConfigError

_INSTR = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"')
_NOT_KERNELS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")


def _node_of(op_name: str, names: set[str]) -> str | None:
    for part in op_name.split("/"):
        if part in names:
            return part
    return None


def _instruction(event: str) -> str:
    """The instruction name an XLA trace event stands for: TPU traces name events by the instruction's
    whole text (measured on a v5e, jax 0.10.2), CPU traces by its name."""
    if event.startswith("%"):
        return event[1:].split(" ", 1)[0]
    return event


def node_seconds(compiled: Any, trace_dir: str | Path) -> dict[str, float]:
    """``{node name: seconds}`` summed over every XLA event of the newest trace under ``trace_dir``
    (written by ``jax.profiler.trace(trace_dir)`` around calls of ``compiled``, a TPUCompiledStep).
    Events whose instruction names no node (runtime copies, parameters) count under their own name.
    For a HostSplitCompiledStep (``embedding_backend="cpu"``) its device part's: the host lookups and
    row updates run in PyTorch, outside the XLA trace."""
    from jax.profiler import ProfileData

    compiled = getattr(compiled, "device", compiled)

    if getattr(compiled, "_compiled", None) is None:
        raise ConfigError("node_seconds: the step has not run yet. Fix: profile calls after the first one.")
    traces = sorted(Path(trace_dir).glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise ConfigError(
            f"node_seconds: no *.xplane.pb under {trace_dir}. Fix: run the steps inside "
            f"jax.profiler.trace({str(trace_dir)!r})."
        )
    names = {n.name for n in compiled.step.graph.nodes}
    instr_node: dict[str, str] = {}
    for line in compiled._compiled.as_text().splitlines():
        m = _INSTR.match(line)
        if m is not None:
            node = _node_of(m.group(2), names)
            if node is not None:
                instr_node[m.group(1)] = node
    seconds: dict[str, float] = {}
    for plane in ProfileData.from_file(str(traces[-1])).planes:
        for line in plane.lines:
            if not line.name.startswith(("tf_XLA", "XLA")):
                continue
            for event in line.events:
                if event.name.startswith(_NOT_KERNELS) or not event.name:
                    continue
                name = _instruction(event.name)
                key = instr_node.get(name, name)
                seconds[key] = seconds.get(key, 0.0) + event.duration_ns * 1e-9
    return seconds
