"""The state-slot name grammar, its one formatter and parser.

``param:<path>`` and ``buffer:<path>`` (a module path), ``optim:<path>:<key>`` (a parameter's optimizer
state, torch.optim's key), ``optim:group<i>:lr`` (a param group's learning rate), ``optim:<name>`` (a
shared scalar: ``optim:step``, the step count), ``rng:<name>`` (``rng:seed``, ``rng:offset``) and
``carry:<stage>:<name>`` (a value a software-pipelined step computed from a later batch, ``recir-pipeline-sparse``).
"""

from __future__ import annotations

import dataclasses
import re

from ._errors import ConfigError

SLOT_KINDS: tuple[str, ...] = ("param", "buffer", "optim", "rng", "carry")
STEP_SLOT = "optim:step"
RNG_SEED_SLOT = "rng:seed"
RNG_OFFSET_SLOT = "rng:offset"
_LR = re.compile(r"optim:group(\d+):lr")


def param_slot(path: str) -> str:
    """``param:<path>``: the slot of the parameter at module path ``path``."""
    return f"param:{path}"


def buffer_slot(path: str) -> str:
    return f"buffer:{path}"


def optim_slot(path: str, key: str) -> str:
    """``optim:<path>:<key>``: optimizer state ``key`` (``exp_avg``, ``sum``) of parameter ``path``."""
    return f"optim:{path}:{key}"


def lr_slot(group: int) -> str:
    """``optim:group<i>:lr``: the learning rate of param group ``group``."""
    return f"optim:group{group}:lr"


def rng_slot(name: str) -> str:
    return f"rng:{name}"


def carry_slot(stage: int, name: str) -> str:
    """``carry:<stage>:<name>``: value ``name`` of the batch ``stage + 1`` calls ahead, carried in state."""
    return f"carry:{stage}:{name}"


@dataclasses.dataclass(frozen=True)
class SlotName:
    """A parsed state-slot name.

    ``kind`` is the prefix; ``path`` the module path (``param``/``buffer``/per-parameter ``optim``
    slots, else None); ``key`` the optimizer state key or the rng stream's name; ``group`` the param
    group of a learning-rate slot. ``str()`` gives the name back.
    """

    kind: str
    path: str | None = None
    key: str | None = None
    group: int | None = None

    @property
    def is_lr(self) -> bool:
        return self.group is not None

    @property
    def is_step(self) -> bool:
        return self.kind == "optim" and self.path is None and self.key == "step"

    def __str__(self) -> str:
        if self.kind in ("param", "buffer"):
            return f"{self.kind}:{self.path}"
        if self.kind == "rng":
            return rng_slot(str(self.key))
        if self.kind == "carry":
            return f"carry:{self.key}"
        if self.group is not None:
            return lr_slot(self.group)
        if self.path is None:
            return f"optim:{self.key}"
        return optim_slot(self.path, str(self.key))


def parse_slot_name(name: str) -> SlotName:
    """Parse a state-slot name; raises ConfigError naming the grammar when it is none of its forms.

    ``optim:group<i>:lr`` is a learning rate (not the ``lr`` state of a parameter named ``group<i>``);
    a per-parameter ``optim`` name splits at its last ``:`` (the key never contains one).
    """
    kind, sep, rest = name.partition(":")
    if sep and rest and kind in ("param", "buffer"):
        return SlotName(kind, path=rest)
    if sep and rest and kind in ("rng", "carry"):
        return SlotName(kind, key=rest)
    if sep and rest and kind == "optim":
        lr = _LR.fullmatch(name)
        if lr is not None:
            return SlotName("optim", key="lr", group=int(lr.group(1)))
        path, colon, key = rest.rpartition(":")
        if not colon:
            return SlotName("optim", key=rest)  # a shared scalar: optim:step
        if path and key:
            return SlotName("optim", path=path, key=key)
    raise ConfigError(
        f"state slot name {name!r} is not of the grammar param:<path>, buffer:<path>, optim:<path>:<key>, "
        "optim:group<i>:lr, optim:<name>, rng:<name> or carry:<stage>:<name>. Fix: name the slot with "
        "recir.transforms' param_slot / buffer_slot / optim_slot / lr_slot / rng_slot / carry_slot."
    )


def slot_path(name: str) -> str | None:
    """The module path a slot belongs to (``param:``/``buffer:``/per-parameter ``optim:``), else None."""
    return parse_slot_name(name).path
