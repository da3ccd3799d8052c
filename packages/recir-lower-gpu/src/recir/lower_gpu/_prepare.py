"""Graph preparation before Inductor: device retargeting, kernel checks, and the in-place epilogue.

Everything here works on a private copy of the StepGraph's GraphModule; the user's step is untouched.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import OVERRIDE_KEY, PHASE_KEY, LoweringError, format_window, override_for_op
from recir.transforms import (
    copy_graph_module as copy_graph_module,  # its home; _compile and _export import it here
)

_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_COMPOSITE_KEYS = (
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
    "CompositeImplicitAutograd",
)


def retarget_devices(gm: fx.GraphModule, device: torch.device) -> int:
    """Rewrite ``device=`` arguments (factory ops, ``_to_copy``) and tensor constants to ``device``.

    A graph captured on one device (capture traces on the host) then runs on another. Returns the
    number of rewritten nodes.
    """
    changed = 0
    for node in gm.graph.nodes:
        dev = node.kwargs.get("device")
        if isinstance(dev, torch.device) and dev != device:
            node.kwargs = {**node.kwargs, "device": device}
            changed += 1
        if node.op == "get_attr":
            value = getattr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(gm, str(node.target), value.to(device))
                changed += 1
    if changed:
        gm.recompile()
    return changed


@functools.cache
def _decompositions() -> frozenset[Any]:
    from torch._decomp import core_aten_decompositions
    from torch._inductor.decomposition import select_decomp_table

    return frozenset(select_decomp_table()) | frozenset(core_aten_decompositions())


def _inductor_handles(op: torch._ops.OpOverload) -> bool:
    from torch._inductor.lowering import lowerings

    return op in lowerings or op.overloadpacket in lowerings or op in _decompositions()


def has_runtime_kernel(op: torch._ops.OpOverload, device_type: str) -> bool:
    """Whether the dispatcher can run ``op`` on ``device_type`` (a device or composite kernel)."""
    name = op.name()
    keys = (_DEVICE_KEYS.get(device_type, device_type.upper()), *_COMPOSITE_KEYS)
    return any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k) for k in keys)


def check_kernels(gm: fx.GraphModule, device: torch.device) -> None:
    """Raise LoweringError for the first node Inductor can neither generate code for nor call.

    Override ops (``recir::*`` and nodes tagged ``recir.override``) must have a runtime kernel for the
    device: Inductor calls them as fallback kernels at graph boundaries. Other ops pass when Inductor
    has a lowering or decomposition for them, or the dispatcher has a kernel it can fall back to.
    """
    dtype_name = device.type.upper()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        op = node.target
        override = node.meta.get(OVERRIDE_KEY) or override_for_op(op)
        is_opaque = op.namespace == "recir" or override is not None
        if is_opaque:
            ok = has_runtime_kernel(op, device.type)
        else:
            ok = _inductor_handles(op) or has_runtime_kernel(op, device.type)
        if ok:
            continue
        phase = node.meta.get(PHASE_KEY, "?")
        what = f"override op {op.name()} (override {override!r})" if is_opaque else f"op {op.name()}"
        if is_opaque:
            fix = (
                f"register its runtime kernel, e.g. torch.library.register_kernel('{op.name()}', "
                f"'{device.type}')(fn) or a device-agnostic torch.library.custom_op implementation; "
                "for embedding ops, embedding_backend='in_graph' lowers them to plain ATen instead."
            )
        else:
            fix = (
                f"run on a device with a {dtype_name} kernel for it, or replace the op in the model "
                "(or register a decomposition) before capture."
            )
        raise LoweringError(
            f"recir.lower_gpu: cannot lower node %{node.name} ({phase} phase): {what} has no "
            f"{dtype_name} kernel and Inductor has no lowering or decomposition for it.\n"
            f"{format_window(node.graph, node, radius=3)}\nFix: {fix}"
        )


def add_in_place_epilogue(gm: fx.GraphModule, num_state: int) -> fx.GraphModule:
    """``(state, batch) -> (new_state, outputs)`` becomes ``(state, batch) -> outputs`` that ``copy_``s
    each new state into its input.

    AOTAutograd sees input mutations and keeps them in the graph; Inductor then writes the new value
    straight into the input's storage (fusing the copy into the kernel that computes it) wherever it can.
    Rewrites ``gm`` in place (callers pass their private copy) and returns it.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    flat = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    new_state, user_out = flat[:num_state], flat[num_state:]
    state_inputs = placeholders[:num_state]
    with graph.inserting_before(output):
        # A new-state value that IS another state input (a swap, a tied update) must be read before
        # any copy lands; a user output that is a state input must keep the pre-step value.
        def snapshot(value: fx.Node) -> fx.Node:
            return graph.call_function(torch.ops.aten.clone.default, (value,))

        srcs = [
            snapshot(v) if isinstance(v, fx.Node) and v in state_inputs and v is not state_inputs[i] else v
            for i, v in enumerate(new_state)
        ]
        outs = [snapshot(v) if isinstance(v, fx.Node) and v in state_inputs else v for v in user_out]
        for dst, src in zip(state_inputs, srcs):
            if src is dst:
                continue  # unchanged state: nothing to write
            graph.call_function(torch.ops.aten.copy_.default, (dst, src))
    output.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return gm
