"""Graph-editing helpers the collective-inserting transforms share: inserting a
functional collective with its ``wait_tensor``, and recomputing every ``val`` for per-device shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from recir.transforms import PHASE_KEY, SHARDING_KEY, BatchSlot, ConfigError, Signature, StateSlot, StepGraph
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

C10D = torch.ops._c10d_functional
COLLECTIVES = (
    C10D.all_reduce.default,
    C10D.reduce_scatter_tensor.default,
    C10D.all_gather_into_tensor.default,
    C10D.all_to_all_single.default,
)


def collective(
    graph: fx.Graph,
    op: Any,
    args: Sequence[Any],
    *,
    phase: str,
    sharding: dict[str, Any] | None = None,
) -> fx.Node:
    """Insert ``wait_tensor(op(*args))`` at the graph's insertion point; returns the wait node."""
    start = graph.call_function(op, tuple(args))
    wait = graph.call_function(C10D.wait_tensor.default, (start,))
    for node in (start, wait):
        node.meta[PHASE_KEY] = phase
        if sharding is not None:
            node.meta[SHARDING_KEY] = dict(sharding)
    return wait


def call(graph: fx.Graph, op: Any, *args: Any, phase: str) -> fx.Node:
    """Insert one ATen call with a phase (its ``val`` comes from :func:`repropagate`)."""
    node = graph.call_function(op, tuple(args))
    node.meta[PHASE_KEY] = phase
    return node


def with_local_state(step: StepGraph, shapes: dict[str, tuple[int, ...]]) -> StepGraph:
    """The step with some state slots resized to the per-device shapes in ``shapes``."""
    state = tuple(
        StateSlot(s.name, s.kind, tuple(shapes[s.name]), s.dtype) if s.name in shapes else s
        for s in step.signature.state
    )
    sig = Signature(
        state,
        step.signature.batch,
        step.signature.outputs,
        step.signature.batch_spec,
        step.signature.output_spec,
    )
    return step.replace(signature=sig)


def repropagate(step: StepGraph, transform: str) -> StepGraph:
    """Recompute every node's ``val`` from the signature's (per-device) shapes with fake tensors."""
    step.graph.lint()
    step.graph_module.recompile()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    phs = [n for n in step.graph.nodes if n.op == "placeholder"]
    slots: list[StateSlot | BatchSlot] = [*step.signature.state, *step.signature.batch]
    inputs = []
    with mode:
        for ph, slot in zip(phs, slots):
            old = ph.meta.get("val")
            device = old.device if isinstance(old, torch.Tensor) else torch.device("cpu")
            inputs.append(torch.empty(slot.shape, dtype=slot.dtype, device=device))
    old = {
        n: tuple(n.meta["val"].shape) for n in step.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
    }
    try:
        _ShapeFollowingProp(step.graph_module, mode, old).propagate_dont_convert_inputs(*inputs)
        step.graph_module.recompile()
    except Exception as exc:
        raise ConfigError(
            f"{transform}: the rewritten graph does not type-check with per-device shapes: {exc}. "
            "A node with a hard-coded global shape reads a sharded value; "
            "fix: replicate that slot in the plan or report the op."
        ) from exc
    return step


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


class _ShapeFollowingProp(FakeTensorProp):
    """FakeTensorProp that rewrites a view/reshape which only adds or drops size-1 dims of a value that is
    now sharded (e.g. RowWiseAdagrad's ``scale.reshape(rows, 1)``) to the value's per-device shape."""

    def __init__(self, gm: fx.GraphModule, mode: FakeTensorMode, old: dict[fx.Node, tuple[int, ...]]) -> None:
        super().__init__(gm, mode)
        self.old = old

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and n.target in _VIEWS and isinstance(n.args[0], fx.Node):
            src, shape = n.args[0], n.args[1]
            new_in, old_in = self.env.get(src), self.old.get(src)
            if (
                isinstance(new_in, torch.Tensor)
                and old_in is not None
                and isinstance(shape, (list, tuple))
                and all(isinstance(d, int) for d in shape)
                and tuple(new_in.shape) != old_in
                and len(new_in.shape) == len(old_in)
            ):
                pos_in = [i for i, d in enumerate(old_in) if d != 1]
                pos_out = [i for i, d in enumerate(shape) if d != 1]
                if [old_in[i] for i in pos_in] == [shape[i] for i in pos_out]:
                    fixed = list(shape)
                    for i, o in zip(pos_in, pos_out):
                        fixed[o] = int(new_in.shape[i])
                    n.update_arg(1, fixed)
        return super().run_node(n)
