"""Running make_fx over the pure step, and turning tracing failures into CaptureErrors that say the fix.

The recorder collects what the traced function learns (phase marks, gradient nodes, outputs) so the
post-processing can tag the graph.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from recir.transforms import BatchSlot, CaptureError, OutputSlot, StateSlot
from torch._functorch._aot_autograd.functional_utils import from_fun, has_data_mutation
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, make_fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from ._decomp import capture_decompositions
from ._slots import path_name
from ._trace_context import TraceContext
from ._update_copies import UpdateCopies


@dataclasses.dataclass
class Recorder:
    marks: dict[str, int] = dataclasses.field(default_factory=dict)
    param_ranges: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    grad_nodes: dict[str, fx.Node | None] = dataclasses.field(default_factory=dict)
    unused: list[str] = dataclasses.field(default_factory=list)
    outputs: list[OutputSlot] = dataclasses.field(default_factory=list)
    output_spec: pytree.TreeSpec | None = None
    ctx: TraceContext | None = None
    update_copies: UpdateCopies = dataclasses.field(default_factory=UpdateCopies)


def node_of(t: torch.Tensor) -> fx.Node | None:
    """The graph node currently holding ``t`` (a functional tensor being traced)."""
    mode = get_proxy_mode()
    if mode is None:
        return None
    inner = from_fun(t)
    slot = get_proxy_slot(inner, mode.tracer, None)
    return slot.proxy.node if slot is not None else None


def split_loss(result: Any, rec: Recorder) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``loss`` or ``(loss, aux...)`` -> (scalar loss, aux leaves); records output slots and spec."""
    items = tuple(result) if isinstance(result, (tuple, list)) else (result,)
    loss = items[0] if items else None
    if not isinstance(loss, torch.Tensor):
        raise CaptureError(
            f"loss_fn returned {type(loss).__name__} as the loss; it must return a tensor or (loss, aux...).\n"
            "Fix: return the loss tensor first."
        )
    if loss.numel() != 1 or not loss.dtype.is_floating_point:
        raise CaptureError(
            f"the loss must be a floating-point scalar, got {str(loss.dtype).removeprefix('torch.')}"
            f"{list(loss.shape)}.\nFix: reduce it in loss_fn, e.g. `loss.mean()` or `loss.sum()`."
        )
    aux_leaves, spec = pytree.tree_flatten_with_path(items[1:])
    aux = []
    rec.outputs = [OutputSlot("loss", (), loss.dtype)]
    for path, leaf in aux_leaves:
        name = f"aux.{path_name(path, '0')}"
        if not isinstance(leaf, torch.Tensor):
            raise CaptureError(
                f"loss_fn's auxiliary output {name} is a {type(leaf).__name__}; graph outputs must be tensors.\n"
                "Fix: return tensors (e.g. torch.as_tensor) or drop the value."
            )
        aux.append(leaf.detach())
        rec.outputs.append(OutputSlot(name, tuple(leaf.shape), leaf.dtype))
    rec.output_spec = pytree.tree_flatten((loss, *items[1:]))[1]
    return loss, aux


def check_inputs_unmutated(
    state: Sequence[torch.Tensor],
    batch: Sequence[torch.Tensor],
    slots: Sequence[StateSlot],
    bslots: Sequence[BatchSlot],
) -> None:
    for t, b in zip(batch, bslots):
        if has_data_mutation(t):
            raise CaptureError(
                f"the step modifies batch tensor {b.name!r} in place (through a view or an op capture did "
                "not see directly).\nFix: clone the batch tensor before modifying it, or use out-of-place ops."
            )
    for t, s in zip(state, slots):
        if s.kind == "param" and has_data_mutation(t):
            raise CaptureError(
                f"the forward modifies parameter {s.name!r} in place; only the optimizer may update "
                "parameters in a captured step.\nFix: compute a new tensor instead of writing into the "
                "parameter (e.g. `w = self.weight.clamp(...)` rather than `self.weight.data.clamp_(...)`)."
            )


def trace(
    fn: Callable[..., Any], fake_mode: FakeTensorMode, args: Sequence[torch.Tensor], rec: Recorder
) -> fx.GraphModule:
    """make_fx with the curated table; known tracing failures become CaptureErrors naming the fix."""
    try:
        with fake_mode:
            return make_fx(fn, decomposition_table=capture_decompositions())(*args)
    except CaptureError:
        raise
    except (DataDependentOutputException, GuardOnDataDependentSymNode) as e:
        raise CaptureError(
            f"a Python value depends on tensor data ({_op_text(e)}) {_where(rec, e)}.\n"
            "Capture traces the step once with shape-only fake tensors, so `.item()`, `bool(t)`, `int(t)` "
            "and `if`/`while` on tensor values cannot be recorded. Fix: keep the value a tensor "
            "(`torch.where(cond, a, b)` instead of `if`, masks instead of data-dependent slicing), pad to a "
            "static size, or put the module behind an Override with a recir:: custom op."
        ) from None
    except DynamicOutputShapeException as e:
        raise CaptureError(
            f"op {_op_text(e)} has an output shape that depends on tensor data {_where(rec, e)}.\n"
            "Fix: use a static-shape formulation (masking with torch.where, `nonzero(..., size=N)`-style "
            "padding, fixed-size buckets), or an Override for the module."
        ) from None
    except UnsupportedOperatorException as e:
        raise CaptureError(
            f"op {_op_text(e)} has no fake (shape-only) implementation {_where(rec, e)}.\n"
            "Fix: wrap the module in an Override whose stand-in calls a recir:: custom op with "
            "register_fake, or replace the op."
        ) from None
    except Exception as e:
        raise CaptureError(
            f"tracing the training step failed {_where(rec, e)}: {type(e).__name__}: {e}\n"
            "Fix: see the cause above; a module that cannot be traced can be swapped by an Override."
        ) from e


def _op_text(e: BaseException) -> str:
    func = getattr(e, "func", None)
    return str(func) if func is not None else str(e).split("\n")[0][:200]


def _where(rec: Recorder, e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    if rec.ctx is not None:
        return rec.ctx.where(frames)
    return ""
