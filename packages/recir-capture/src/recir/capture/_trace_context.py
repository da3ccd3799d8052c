"""What capture watches while it traces: the module being run, the user's source line, randomness, mutations.

A ``TorchFunctionMode`` routes dropout and ``torch.rand*`` to the counter-based RNG of ``_rng`` (state
carried in ``rng:*`` slots) and rejects in-place writes to the batch with a :class:`CaptureError`.
"""

from __future__ import annotations

import contextlib
import os
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from recir.transforms import CaptureError
from torch import Tensor, nn
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode

from . import _rng

_TORCH_DIR = os.path.dirname(torch.__file__)
_PKG_DIR = os.path.dirname(__file__)
_STDLIB_DIR = sysconfig.get_paths()["stdlib"]
_NOT_MUTATIONS = {"requires_grad_", "retain_grad", "share_memory_", "record_stream", "detach_"}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__"}


def user_frame(frames: traceback.StackSummary | list[traceback.FrameSummary]) -> str | None:
    """``file:line: code`` of the innermost frame in user code (not torch, stdlib or capture itself)."""
    for fr in reversed(list(frames)):
        fn = fr.filename
        if fn.startswith("<") or fn.startswith(_TORCH_DIR) or fn.startswith(_STDLIB_DIR):
            continue
        if os.path.dirname(fn) == _PKG_DIR and os.path.basename(fn) != "_testing_models.py":
            continue
        return f"{fn}:{fr.lineno}: {(fr.line or '').strip()}"
    return None


class TraceContext:
    """Per-capture tracing state: module stack, batch identities, the lazily built RNG key."""

    def __init__(self, batch_names: dict[int, str], rng_key: Callable[[], Tensor]) -> None:
        self.module_stack: list[str] = []
        # (graph node count, module path) at every module entry and exit: nodes traced from then on
        # compute for that module (postprocess.tag_scopes reads them by position)
        self.scope_marks: list[tuple[int, str]] = []
        self.batch_names = batch_names
        self._rng_key_fn = rng_key
        self._rng_key: Tensor | None = None
        self.rng_counter = 0
        self.random_ops: list[str] = []
        # the traced graph, and the position of every dropout keep-mask node in it (tag_rng_masks)
        self.graph: Any = None
        self.mask_marks: list[int] = []
        self.dropout_marks: list[tuple[int, float]] = []  # (position of each dropout's output node, p)

    @property
    def module(self) -> str:
        return self.module_stack[-1] if self.module_stack else "<loss_fn>"

    def where(self, frames: Any = None) -> str:
        line = user_frame(frames if frames is not None else traceback.extract_stack())
        return f"in module {self.module!r}" + (f" at {line}" if line else "")

    # -- randomness --------------------------------------------------------------------------------
    def take_counters(self, n: int, what: str) -> tuple[Tensor, int]:
        if self._rng_key is None:
            self._rng_key = self._rng_key_fn()
        self.random_ops.append(what)
        base = self.rng_counter
        self.rng_counter += n
        return self._rng_key, base

    def uniform(self, shape: Any, dtype: torch.dtype, what: str) -> Tensor:
        n = _numel(shape)
        key, base = self.take_counters(n, what)
        return _rng.uniform(key, base, tuple(shape), dtype)

    def normal(self, shape: Any, dtype: torch.dtype, what: str) -> Tensor:
        n = _numel(shape)
        key, base = self.take_counters(2 * n, what)
        return _rng.normal(key, base, tuple(shape), dtype)

    # -- mutation checks ---------------------------------------------------------------------------
    def check_mutation(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = getattr(func, "__name__", "")
        inplace = (name.endswith("_") and not name.startswith("__") and name not in _NOT_MUTATIONS) or (
            name in _INPLACE_DUNDERS
        )
        targets = [args[0]] if inplace and args else []
        out = kwargs.get("out")
        targets += list(out) if isinstance(out, (tuple, list)) else [out] if out is not None else []
        for t in targets:
            slot = self.batch_names.get(id(t))
            if slot is not None:
                raise CaptureError(
                    f"the step modifies batch tensor {slot!r} in place ({name}) {self.where()}.\n"
                    "A captured step must not write into its inputs (the batch is reused and may be "
                    "donated). Fix: work on a copy, e.g. `x = batch[...].clone()` before modifying it, "
                    "or use the out-of-place op."
                )


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _size_arg(args: tuple[Any, ...]) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(args)


def _dropout(ctx: TraceContext, input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
    if not training or p == 0:
        return input
    if p == 1:
        out = input * 0
    else:
        keep = ctx.uniform(input.shape, torch.float32, "dropout") < (1 - p)
        if ctx.graph is not None:  # the node just traced is the mask: postprocess.tag_rng_masks tags it
            ctx.mask_marks.append(len(ctx.graph.nodes) - 1)
        out = input * (keep.to(input.dtype) / (1 - p))
        if ctx.graph is not None:
            ctx.dropout_marks.append((len(ctx.graph.nodes) - 1, float(p)))
    if inplace:
        return input.copy_(out)
    return out


def _vf_dropout(ctx: TraceContext, input: Tensor, p: float, train: bool):
    return _dropout(ctx, input, p, train)


def _rand(ctx: TraceContext, *size: Any, dtype: torch.dtype | None = None, **_: Any) -> Tensor:
    return ctx.uniform(_size_arg(size), dtype or torch.get_default_dtype(), "rand")


def _randn(ctx: TraceContext, *size: Any, dtype: torch.dtype | None = None, **_: Any) -> Tensor:
    return ctx.normal(_size_arg(size), dtype or torch.get_default_dtype(), "randn")


def _rand_like(ctx: TraceContext, t: Tensor, *, dtype: torch.dtype | None = None, **_: Any) -> Tensor:
    return ctx.uniform(t.shape, dtype or t.dtype, "rand_like")


def _randn_like(ctx: TraceContext, t: Tensor, *, dtype: torch.dtype | None = None, **_: Any) -> Tensor:
    return ctx.normal(t.shape, dtype or t.dtype, "randn_like")


def _bernoulli(ctx: TraceContext, input: Tensor, p: float | None = None, **_: Any) -> Tensor:
    probs = input if p is None else torch.full_like(input, p)
    return (ctx.uniform(input.shape, torch.float32, "bernoulli") < probs).to(input.dtype)


_RANDOM: dict[Any, Callable[..., Any]] = {
    F.dropout: _dropout,
    torch.dropout: _vf_dropout,
    torch.rand: _rand,
    torch.randn: _randn,
    torch.rand_like: _rand_like,
    torch.randn_like: _randn_like,
    torch.bernoulli: _bernoulli,
    Tensor.bernoulli: _bernoulli,
}


_BACKWARD_CALLS = {Tensor.backward, torch.autograd.backward}  # autograd.grad (penalties) stays allowed


class CaptureFunctionMode(TorchFunctionMode):
    """Routes RNG calls to the state-carried RNG and checks in-place writes to the batch."""

    def __init__(self, ctx: TraceContext) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _RANDOM.get(func)
        if handler is not None:
            return handler(self.ctx, *args, **kwargs)
        if func in _BACKWARD_CALLS:
            raise CaptureError(
                f"loss_fn runs a backward pass ({getattr(func, '__qualname__', func)}) {self.ctx.where()}.\n"
                "Capture adds the backward and the optimizer step itself. Fix: make loss_fn only compute and "
                "return the loss (or (loss, aux...)); no .backward(), zero_grad() or optimizer.step() in it."
            )
        if self.ctx.batch_names:
            self.ctx.check_mutation(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def track_modules(ctx: TraceContext, root: nn.Module) -> Iterator[None]:
    """Keep ``ctx.module_stack`` as the path of the module running now (left as-is when one raises)."""
    paths = {id(m): (p or "<root>") for p, m in root.named_modules(remove_duplicate=False)}
    mode = get_proxy_mode()
    graph = mode.tracer.graph if mode is not None else None

    def mark() -> None:
        if graph is not None:
            scope = ctx.module_stack[-1] if ctx.module_stack else ""
            ctx.scope_marks.append((len(graph.nodes), "" if scope == "<root>" else scope))

    def pre(module: nn.Module, args: Any) -> None:
        path = paths.get(id(module))
        if path is not None:
            ctx.module_stack.append(path)
            mark()

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if id(module) in paths and ctx.module_stack:
            ctx.module_stack.pop()
            mark()

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()
