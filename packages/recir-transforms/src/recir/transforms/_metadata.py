"""The metadata keys packages share, defined once, with typed accessors.

Node keys: ``recir.grad_of`` (on the node holding a parameter's final gradient: that ``param:`` slot)
and ``recir.optim_param`` (on each optimizer node: the ``param:`` slot it updates); both set by
recir-capture, read by recir-distributed and recir-embedding. Step key: ``step.meta["recir.optimizer"]``
(``param:`` slot -> its optimizer, plain data; :class:`OptimizerInfo` reads it). The phase, sharding
and override keys live beside the IR in ``_step.py`` (``PHASE_KEY``, ``SHARDING_KEY``, ``OVERRIDE_KEY``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._step import StepGraph

GRAD_OF_KEY = "recir.grad_of"
OPTIM_PARAM_KEY = "recir.optim_param"
#: ``step.meta[OPTIMIZER_KEY]``: ``param:`` slot -> ``{"kind", "group", "hparams", "state", "lr_slot",
#: "step_slot"}`` (see :class:`OptimizerInfo`); plain data so it pickles and prints.
OPTIMIZER_KEY = "recir.optimizer"


@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
    """One parameter's optimizer as the step records it.

    ``kind`` is the functional optimizer (``sgd``, ``adam``, ``adamw``, ``adagrad``,
    ``rowwise_adagrad``); ``hparams`` its hyper-parameters; ``state`` maps torch.optim's state keys to
    their ``optim:`` slots; ``lr_slot`` is the group's learning-rate slot, ``step_slot`` the shared step
    count (None when the optimizer keeps none).
    """

    kind: str
    group: int
    hparams: Mapping[str, Any]
    state: Mapping[str, str]
    lr_slot: str
    step_slot: str | None = None

    @classmethod
    def from_meta(cls, param: str, entry: Mapping[str, Any]) -> OptimizerInfo:
        missing = [k for k in ("kind", "lr_slot") if k not in entry]
        if missing:
            raise ConfigError(
                f"step.meta[{OPTIMIZER_KEY!r}][{param!r}] lacks {missing}; it has {sorted(entry)}. "
                "Fix: build the entry with OptimizerInfo(...).to_meta()."
            )
        return cls(
            kind=str(entry["kind"]),
            group=int(entry.get("group", 0)),
            hparams=dict(entry.get("hparams", {})),
            state=dict(entry.get("state", {})),
            lr_slot=str(entry["lr_slot"]),
            step_slot=entry.get("step_slot"),
        )

    def to_meta(self) -> dict[str, Any]:
        """The plain-data entry stored under ``step.meta[OPTIMIZER_KEY][param]``."""
        return {
            "kind": self.kind,
            "group": self.group,
            "hparams": dict(self.hparams),
            "state": dict(self.state),
            "lr_slot": self.lr_slot,
            "step_slot": self.step_slot,
        }

    def slots(self) -> list[str]:
        """Every state slot the update reads besides the parameter: its state, lr and step slots."""
        return [*self.state.values(), self.lr_slot, *([self.step_slot] if self.step_slot else [])]


def optimizer_infos(step: StepGraph) -> dict[str, OptimizerInfo]:
    """``param:`` slot -> :class:`OptimizerInfo` from ``step.meta[OPTIMIZER_KEY]`` ({} when absent)."""
    return {p: OptimizerInfo.from_meta(p, e) for p, e in step.meta.get(OPTIMIZER_KEY, {}).items()}


def set_optimizer_infos(step: StepGraph, infos: Mapping[str, OptimizerInfo]) -> None:
    step.meta[OPTIMIZER_KEY] = {p: info.to_meta() for p, info in infos.items()}


def grad_of(node: fx.Node) -> str | None:
    """The ``param:`` slot whose final gradient ``node`` holds, or None."""
    value = node.meta.get(GRAD_OF_KEY)
    return None if value is None else str(value)


def optim_param(node: fx.Node) -> str | None:
    """The ``param:`` slot whose optimizer update ``node`` belongs to, or None."""
    value = node.meta.get(OPTIM_PARAM_KEY)
    return None if value is None else str(value)


def grad_nodes(step: StepGraph) -> dict[str, fx.Node]:
    """``param:`` slot -> the node holding its final gradient (``recir.grad_of``)."""
    out: dict[str, fx.Node] = {}
    for node in step.graph.nodes:
        slot = grad_of(node)
        if slot is not None:
            out[slot] = node
    return out
