"""A structural copy of the user's model (new module objects, same parameter and buffer tensors).

Overrides and the fake-tensor binding during tracing edit only this copy, so the user's model is
never mutated, not even temporarily.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from recir.transforms import CaptureError, Override, apply_overrides
from torch import Tensor, nn


def structural_copy(module: nn.Module) -> nn.Module:
    """New module objects with their own ``_modules``/``_parameters``/``_buffers`` dicts, sharing tensors."""
    memo: dict[int, nn.Module] = {}

    def visit(m: nn.Module) -> nn.Module:
        if id(m) in memo:
            return memo[id(m)]
        new = copy.copy(m)
        memo[id(m)] = new
        new._parameters = dict(m._parameters)
        new._buffers = dict(m._buffers)
        new._modules = {k: (visit(c) if c is not None else None) for k, c in m._modules.items()}
        return new

    return visit(module)


def prepare_model(
    model: nn.Module, overrides: tuple[Override, ...]
) -> tuple[nn.Module, list[tuple[str, Override]]]:
    """The copy to trace, with overrides applied; checks stand-ins kept the parameter and buffer names."""
    work = structural_copy(model)
    if not overrides:
        return work, []
    work, applied = apply_overrides(work, overrides)
    for kind, ours, theirs in (
        ("parameters", work.named_parameters(), model.named_parameters()),
        ("buffers", work.named_buffers(), model.named_buffers()),
    ):
        got = {n: id(t) for n, t in ours}
        want = {n: id(t) for n, t in theirs}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))
            names = sorted({n for n, _ in diff})[:6]
            raise CaptureError(
                f"overrides {[ov.name for _, ov in applied]} changed the model's {kind} (mismatch at {names}); "
                "a stand-in must register the original tensors under the original attribute names.\n"
                "Fix: in Override.replace, register the replaced module's parameters/buffers on the stand-in "
                "(e.g. `standin.weight = module.weight`)."
            )
    return work, applied


@contextlib.contextmanager
def bind_tensors(work: nn.Module, by_id: dict[int, Tensor]) -> Iterator[None]:
    """Swap every parameter/buffer of ``work`` (the copy) for the tracing tensor of the same original."""
    saved: list[tuple[dict[str, Any], str, Any]] = []
    for _, m in work.named_modules(remove_duplicate=False):
        for table in (m._parameters, m._buffers):
            for k, v in table.items():
                if v is not None and id(v) in by_id:
                    saved.append((table, k, v))
                    table[k] = by_id[id(v)]
    try:
        yield
    finally:
        for table, k, v in saved:
            table[k] = v
