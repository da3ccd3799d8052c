"""The StepGraph's signature: the ordered state, batch and output slots of a pure training step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree

from ._batch_adapters import adapt_batch
from ._errors import ConfigError, DataError

StateKind = Literal["param", "buffer", "optim", "rng", "carry"]
BatchRole = Literal["dense", "ids", "lengths", "offsets", "label", "weight", "other"]
STATE_KINDS: tuple[str, ...] = ("param", "buffer", "optim", "rng", "carry")
BATCH_ROLES: tuple[str, ...] = ("dense", "ids", "lengths", "offsets", "label", "weight", "other")


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class StateSlot:
    """One state tensor: input ``i`` of the state block is replaced by output ``i``.

    Names are stable and readable: ``param:<module path>``, ``buffer:<path>``,
    ``optim:<param path>:<key>``, ``optim:step``, ``rng:<name>``, ``carry:<stage>:<name>`` (a
    software-pipelined step's values of a later batch, see ``recir-pipeline-sparse``).
    """

    name: str
    kind: StateKind
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise ValueError(f"StateSlot {self.name!r}: kind {self.kind!r} is not one of {STATE_KINDS}")

    def __str__(self) -> str:
        return f"{self.name}: {_fmt_dtype(self.dtype)}{_fmt_shape(self.shape)} ({self.kind})"


@dataclass(frozen=True)
class BatchSlot:
    """One flattened batch leaf, with the role it plays (ids, lengths, label, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: BatchRole = "other"

    def __post_init__(self) -> None:
        if self.role not in BATCH_ROLES:
            raise ValueError(f"BatchSlot {self.name!r}: role {self.role!r} is not one of {BATCH_ROLES}")

    def __str__(self) -> str:
        return f"{self.name}: {_fmt_dtype(self.dtype)}{_fmt_shape(self.shape)} ({self.role})"


@dataclass(frozen=True)
class OutputSlot:
    """One user output (the loss first, then metrics/aux)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{self.name}: {_fmt_dtype(self.dtype)}{_fmt_shape(self.shape)}"


@dataclass(frozen=True)
class Signature:
    """``(state..., batch...) -> (new_state..., outputs...)``, plus the spec that rebuilds the batch pytree."""

    state: tuple[StateSlot, ...]
    batch: tuple[BatchSlot, ...]
    outputs: tuple[OutputSlot, ...]
    batch_spec: pytree.TreeSpec | None = None
    output_spec: pytree.TreeSpec | None = field(default=None, compare=False)

    def state_names(self) -> list[str]:
        return [s.name for s in self.state]

    def state_index(self, name: str) -> int:
        for i, s in enumerate(self.state):
            if s.name == name:
                return i
        raise KeyError(f"no state slot named {name!r}; the signature has {len(self.state)} slots")

    def check_state(self, values: Sequence[Any], what: str = "state") -> None:
        """ConfigError unless ``values`` has one tensor per state slot, each of its slot's shape and dtype."""
        if len(values) != len(self.state):
            raise ConfigError(
                f"{what}: expected {len(self.state)} state tensors (signature order), got {len(values)}. "
                "Fix: build them with step.init_state(model, optimizer)."
            )
        for slot, value in zip(self.state, values):
            shape, dtype = tuple(getattr(value, "shape", ())), getattr(value, "dtype", None)
            if shape != slot.shape or dtype != slot.dtype:
                raise ConfigError(
                    f"{what}: state slot {slot.name!r} is {_fmt_dtype(slot.dtype)}{_fmt_shape(slot.shape)}, the "
                    f"value given is {dtype}{list(shape)}. Fix: build the state with step.init_state(model, "
                    "optimizer) of this step (after the transforms that changed its slots)."
                )

    def flatten_batch(self, batch: Any) -> list[torch.Tensor]:
        """Flatten a user batch into the slot order, checking structure, shapes and dtypes. Values a
        registered batch adapter handles (e.g. TorchRec KeyedJaggedTensors) are first converted into the
        captured layout."""
        leaves, spec = pytree.tree_flatten(adapt_batch(batch, self.batch_spec))
        if self.batch_spec is not None and spec != self.batch_spec:
            raise DataError(
                "the batch's structure differs from the captured one.\n"
                f"  expected: {self.batch_spec}\n  actual:   {spec}\n"
                "Fix: pass batches with the same keys and nesting as the example batch used at capture."
            )
        if len(leaves) != len(self.batch):
            raise DataError(f"the batch has {len(leaves)} tensors, the signature expects {len(self.batch)}")
        for slot, leaf in zip(self.batch, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise DataError(f"batch leaf {slot.name!r} is a {type(leaf).__name__}, expected a tensor")
            if tuple(leaf.shape) != slot.shape or leaf.dtype != slot.dtype:
                raise DataError(
                    f"batch leaf {slot.name!r}: expected {_fmt_dtype(slot.dtype)}{_fmt_shape(slot.shape)}, "
                    f"got {_fmt_dtype(leaf.dtype)}{_fmt_shape(tuple(leaf.shape))}. "
                    "Fix: pad or bucket the batch to the captured static shape, or capture with mode='dynamic'."
                )
        return leaves

    def unflatten_batch(self, leaves: list[Any]) -> Any:
        if self.batch_spec is None:
            return list(leaves)
        return pytree.tree_unflatten(list(leaves), self.batch_spec)

    def __str__(self) -> str:
        lines = [f"state ({len(self.state)}):"]
        lines += [f"  {i:3d} {s}" for i, s in enumerate(self.state)]
        lines.append(f"batch ({len(self.batch)}):")
        lines += [f"  {i:3d} {b}" for i, b in enumerate(self.batch)]
        lines.append(f"outputs ({len(self.outputs)}):")
        lines += [f"  {i:3d} {o}" for i, o in enumerate(self.outputs)]
        return "\n".join(lines)
