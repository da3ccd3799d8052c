"""Mesh: named device axes (``{"data": D, "model": M}``) validated against the world size or device count.

The GPU path runs one process per device (torch.distributed); the TPU path maps the axes onto a JAX mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from recir.transforms import ConfigError

KNOWN_AXES: tuple[str, ...] = ("data", "model")


class Mesh:
    """Named device axes, e.g. ``Mesh(axes={"data": 2, "model": 2})`` (4 devices, data-major order).

    Device ``r`` sits at coordinates ``unravel(r, sizes)``: the last axis varies fastest.
    """

    def __init__(self, axes: Mapping[str, int] | None = None, **kwargs: int) -> None:
        merged = dict(axes or {}, **kwargs)
        if not merged:
            raise ConfigError('Mesh needs at least one axis, e.g. Mesh(axes={"data": 2})')
        for name, size in merged.items():
            if name not in KNOWN_AXES:
                raise ConfigError(
                    f"Mesh axis {name!r} is not one of {KNOWN_AXES}. "
                    'Fix: name the batch axis "data" and the table/model axis "model".'
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError(f"Mesh axis {name!r} has size {size!r}; expected a positive int")
        self.axes: dict[str, int] = merged

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """The number of devices (the product of the axis sizes)."""
        return math.prod(self.axes.values())

    def axis_size(self, name: str) -> int:
        """The size of axis ``name`` (1 for an axis the mesh does not have)."""
        return self.axes.get(name, 1)

    @property
    def data_size(self) -> int:
        return self.axis_size("data")

    @property
    def model_size(self) -> int:
        return self.axis_size("model")

    def coords(self, rank: int) -> dict[str, int]:
        """The axis coordinates of device ``rank`` (row-major: the last axis varies fastest)."""
        if not 0 <= rank < self.size:
            raise ConfigError(f"rank {rank} is outside the mesh {self} of {self.size} devices")
        out: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(self.axes.items())):
            out[name] = rest % size
            rest //= size
        return dict(reversed(list(out.items())))

    # -- validation -------------------------------------------------------------------------------
    def validate(self, world_size: int | None = None, *, what: str = "processes") -> Mesh:
        """Check the mesh covers exactly ``world_size`` devices (default: the initialised process group)."""
        if world_size is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                return self
            world_size = dist.get_world_size()
        if world_size != self.size:
            shape = " x ".join(f"{k}={v}" for k, v in self.axes.items())
            raise ConfigError(
                f"mesh {shape} needs {self.size} devices, but there are {world_size} {what}. "
                f"Fix: make the product of the axis sizes equal {world_size} "
                f'(e.g. Mesh(axes={{"data": {world_size}}})) or launch {self.size} {what}.'
            )
        return self

    # -- data -------------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, *, name: str = "mesh") -> Mesh:
        """``"data=8"`` or ``"data=2,model=2"`` (a launcher flag's text) as a Mesh; errors name the text as
        ``name`` (e.g. the flag, ``--mesh``).

        >>> Mesh.parse("data=2,model=2")
        Mesh(axes={'data': 2, 'model': 2})
        """
        axes: dict[str, int] = {}
        for part in text.split(","):
            axis, eq, size = part.strip().partition("=")
            if not eq or not size.strip().isdigit() or int(size) < 1:
                raise ConfigError(
                    f"{name} {text!r}: expected NAME=SIZE[,NAME=SIZE] with SIZE >= 1, e.g. 'data=8' or "
                    "'data=2,model=2'"
                )
            axes[axis.strip()] = int(size)
        return cls(axes=axes)

    def to_dict(self) -> dict[str, Any]:
        return {"axes": dict(self.axes)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Mesh:
        return cls(axes=dict(data["axes"]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and other.axes == self.axes

    def __hash__(self) -> int:
        return hash(tuple(self.axes.items()))

    def __repr__(self) -> str:
        return f"Mesh(axes={self.axes})"
