"""Batch adapters: batch values a StepGraph cannot take as they are, converted at its boundary.

A StepGraph's batch is a pytree of static-shaped tensors. Some batch types users train with are not:
TorchRec's ``KeyedJaggedTensor`` has data-dependent sizes. A package that knows such a type registers a
:class:`BatchAdapter` (recir-embedding registers one for KeyedJaggedTensors); capture converts the example
batch with it under a bucketing policy, and :meth:`Signature.flatten_batch` converts every later batch
into the layout that was captured (so ``step(state, batch)`` and every lowering's compiled step accept
the user's own batch type).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree


class BatchAdapter(Protocol):
    """Converts one batch value type into a static pytree."""

    name: str

    def handles(self, value: Any) -> bool:
        """Whether ``value`` is of the type this adapter converts."""
        ...

    def to_static(self, value: Any, captured: pytree.TreeSpec | None, policy: Any) -> Any:
        """``value`` as a static pytree: laid out like ``captured`` (the TreeSpec the capture saw at this
        position; raise recir's DataError naming the fix when it does not fit), or, at capture
        (``captured`` is None), by the bucketing ``policy`` given to capture."""
        ...


_ADAPTERS: list[BatchAdapter] = []


def register_batch_adapter(adapter: BatchAdapter) -> None:
    """Register ``adapter`` (once per name; a later registration under the same name replaces it)."""
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.name != adapter.name] + [adapter]


def registered_batch_adapters() -> tuple[BatchAdapter, ...]:
    return tuple(_ADAPTERS)


def adapt_batch(batch: Any, captured: pytree.TreeSpec | None = None, policy: Any = None) -> Any:
    """``batch`` with every value a registered adapter handles converted (the rest kept as they are,
    by identity). ``captured``: the batch TreeSpec of a captured step, whose layout each converted
    value must take; None at capture, where ``policy`` picks the layout."""
    if not _ADAPTERS:
        return batch
    return _adapt(batch, captured, policy)


def spec_children(spec: pytree.TreeSpec) -> list[pytree.TreeSpec]:
    """A TreeSpec's child specs: `children()` from torch 2.10, `children_specs` before."""
    children = getattr(spec, "children", None)
    if callable(children):
        return list(children())
    return list(spec.children_specs)


def _adapt(value: Any, spec: pytree.TreeSpec | None, policy: Any) -> Any:
    for adapter in _ADAPTERS:
        if adapter.handles(value):
            return adapter.to_static(value, spec, policy)
    if value is None or isinstance(value, torch.Tensor):
        return value
    node = pytree.SUPPORTED_NODES.get(pytree._get_node_type(value))
    if node is None:
        return value
    children, context = node.flatten_fn(value)
    subs: list[Any] = [None] * len(children)
    if spec is not None and spec.type is pytree._get_node_type(value) and spec.num_children == len(children):
        subs = spec_children(spec)
    new = [_adapt(c, s, policy) for c, s in zip(children, subs)]
    if all(n is c for n, c in zip(new, children)):
        return value
    return node.unflatten_fn(new, context)
