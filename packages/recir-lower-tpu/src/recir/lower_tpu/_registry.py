"""The registry of JAX lowerings: ``register_jax_lowering("recir::op", fn)`` and how an op finds one.

A lowering takes JAX arrays (and the op's non-tensor arguments unchanged) and returns JAX arrays in the
op's output structure. Lookup order for a graph op: this registry (exact overload, then the packet),
then torchax's own table, then, for ``recir::*`` ops, the pure-ATen reference next to the op's definition.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from recir.transforms import reference_for

JaxLowering = Callable[..., Any]
F = TypeVar("F", bound=JaxLowering)

_LOWERINGS: dict[str, JaxLowering] = {}


def op_qualname(op: object) -> str:
    """``ns::name`` or ``ns::name.overload`` for an op object, or the string itself."""
    if isinstance(op, torch._ops.OpOverload):
        base = op._schema.name
        return base if op._overloadname == "default" else f"{base}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, str):
        return op
    raise TypeError(f"expected an op (OpOverload, OpOverloadPacket or 'ns::name'), got {type(op).__name__}")


def register_jax_lowering(op: object, fn: F | None = None, *, replace: bool = True) -> Any:
    """Register ``fn`` (JAX arrays in, JAX arrays out) as the lowering of ``op``.

    ``op`` is ``"recir::name"`` (every overload), ``"aten::name.overload"`` (one overload) or the op
    object. Usable as a decorator: ``@register_jax_lowering("recir::my_op")``. A registered lowering
    wins over torchax's own, so this is also how a wrong torchax lowering is overridden.
    """
    name = op_qualname(op)
    if "::" not in name:
        raise ValueError(f"op names look like 'namespace::name[.overload]', got {name!r}")

    def decorate(f: F) -> F:
        if not replace and name in _LOWERINGS:
            raise ValueError(f"a JAX lowering for {name} is already registered ({_LOWERINGS[name]!r})")
        _LOWERINGS[name] = f
        return f

    return decorate(fn) if fn is not None else decorate


def registered_jax_lowerings() -> dict[str, JaxLowering]:
    """Op name -> JAX lowering, for every registered lowering (RecIR's built-ins included)."""
    return dict(_LOWERINGS)


def jax_lowering_for(op: torch._ops.OpOverload) -> JaxLowering | None:
    """The registered lowering of one op overload (the overload's own, else its packet's), or None."""
    exact = op_qualname(op)
    return _LOWERINGS.get(exact) or _LOWERINGS.get(op._schema.name)


def aten_reference_for(op: torch._ops.OpOverload) -> Callable[..., Any] | None:
    """The pure-ATen reference of a ``recir::*`` custom op (``recir.transforms.reference_for``: by
    convention ``<name>_reference`` beside the op's definition), or None. It runs under torchax, so its
    ATen ops lower like any other graph op."""
    return reference_for(op)
