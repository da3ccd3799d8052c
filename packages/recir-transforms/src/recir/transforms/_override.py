"""Overrides: traceable stand-ins for modules that cannot be traced (TorchRec, FBGEMM TBE, ...).

An override swaps a module, before capture, for a stand-in that calls a ``recir::*`` custom op
(with a fake implementation and a gradient formula). The stand-in shares the original parameters,
so state slot names stay those of the user's model. Overrides live here, in the leaf package, so
that recir-embedding can define them and recir-capture can apply them without depending on each other.
"""

from __future__ import annotations

import abc
import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from ._step import SlotInitializer

_OVERRIDES: dict[str, Override] = {}
_OVERRIDE_OPS: dict[str, str] = {}  # "recir::op" -> override name


class Override(abc.ABC):
    """Replace an untraceable module by a traceable stand-in calling ``recir::*`` ops.

    Subclasses set ``name`` (``recir-<area>-<noun>``) and ``ops`` (qualified names of the custom ops the
    stand-in calls). Nodes of those ops carry ``recir.override = name`` after capture, which is what the
    lowerings read to restore runtime kernels at graph boundaries.
    """

    name: ClassVar[str]
    ops: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def matches(self, module: nn.Module) -> bool:
        """Whether this override handles ``module``."""

    @abc.abstractmethod
    def replace(self, module: nn.Module, path: str) -> nn.Module:
        """A traceable stand-in for ``module`` (at ``path`` in the model) sharing its parameters."""

    def initializers(self) -> tuple[SlotInitializer, ...]:
        """Extra state initializers the stand-in needs (for state it adds beyond parameters)."""
        return ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def register_override(override: Override) -> Override:
    """Register an override (idempotent for the same name); returns it."""
    _OVERRIDES[override.name] = override
    for op in override.ops:
        _OVERRIDE_OPS[op] = override.name
    return override


def registered_overrides() -> dict[str, Override]:
    return dict(_OVERRIDES)


def register_override_op(qualname: str, override_name: str) -> None:
    """Declare ``recir::<op>`` as an opaque op produced by ``override_name`` (INV-6 accepts it)."""
    if not qualname.startswith("recir::"):
        raise ValueError(f"override ops live in the recir namespace, got {qualname!r}")
    _OVERRIDE_OPS[qualname] = override_name


def override_for_op(op: object) -> str | None:
    """The override name that owns ``op`` (an OpOverload/OpOverloadPacket or 'recir::x'), else None."""
    if isinstance(op, torch._ops.OpOverload):
        qualname = op._schema.name
    elif isinstance(op, torch._ops.OpOverloadPacket):
        qualname = op._qualified_op_name
    else:
        qualname = str(op)
    return _OVERRIDE_OPS.get(qualname)


def reference_for(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """The pure-ATen reference of a ``recir::*`` custom op, found by convention, or None.

    Convention (recir-transforms, recir-embedding and the lowerings share it): an op ``recir::<name>``
    defined with ``torch.library.custom_op`` in module M has its reference at ``M.<name>_reference``,
    taking the op's arguments. Lowerings inline it (``InlineReferences``) or trace it (the TPU path).
    """
    if op.namespace != "recir":
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - torch moved it
        return None
    opdef = OPDEFS.get(op._schema.name)
    init_fn = getattr(opdef, "_init_fn", None)
    module_name = getattr(init_fn, "__module__", None)
    if not module_name:
        return None
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    short = op._schema.name.split("::", 1)[1]
    ref = getattr(module, f"{short}_reference", None)
    return ref if callable(ref) else None


def apply_overrides(
    model: nn.Module, overrides: Iterable[Override]
) -> tuple[nn.Module, list[tuple[str, Override]]]:
    """Swap every matching submodule (outermost first) for its stand-in, in place on ``model``'s tree.

    Returns the model (a new root if the root itself matched) and the (path, override) pairs applied.
    Callers that must not mutate the user's model pass a shallow structural copy.
    """
    overrides = list(overrides)
    applied: list[tuple[str, Override]] = []
    for ov in overrides:
        register_override(ov)

    def visit(module: nn.Module, path: str) -> nn.Module:
        for ov in overrides:
            if ov.matches(module):
                applied.append((path, ov))
                return ov.replace(module, path)
        for child_name, child in list(module._modules.items()):
            if child is None:
                continue
            new = visit(child, f"{path}.{child_name}" if path else child_name)
            if new is not child:
                module._modules[child_name] = new
        return module

    return visit(model, ""), applied
