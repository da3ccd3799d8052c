"""Where state and batch arrays live: the default device now, NamedShardings over a mesh later.

With ``mesh=None`` everything sits on JAX's default device. With a mesh, arrays are replicated over it
until sharding plans land (``plan`` is accepted and kept; its placements will map to NamedShardings here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
from recir.distributed import ShardingPlan
from recir.transforms import BatchSlot, ConfigError, StateSlot


def as_jax_mesh(mesh: Any) -> Mesh:
    """A ``jax.sharding.Mesh`` from one, or from an object with ``axes`` (name -> size), e.g. recir's Mesh."""
    if isinstance(mesh, Mesh):
        return mesh
    axes = getattr(mesh, "axes", mesh)
    if not isinstance(axes, Mapping) or not axes:
        raise ConfigError(
            f"mesh must be a jax.sharding.Mesh or have axes {{name: size}}, got {type(mesh).__name__}. "
            "Fix: pass recir.distributed.Mesh(axes={'data': 8}) or a jax Mesh."
        )
    names, sizes = tuple(axes), tuple(int(s) for s in axes.values())
    devices = jax.devices()
    if math.prod(sizes) != len(devices):
        raise ConfigError(
            f"mesh {dict(axes)} needs {math.prod(sizes)} devices, JAX has {len(devices)} "
            f"({jax.default_backend()}). Fix: size the mesh to the devices, or on CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts."
        )
    return jax.make_mesh(sizes, names, devices=devices)


class Placement:
    """The sharding of every state and batch slot (one device, or replicated over a mesh for now)."""

    def __init__(self, mesh: Any = None, plan: ShardingPlan | None = None):
        self.plan = plan
        self.mesh = None if mesh is None else as_jax_mesh(mesh)
        self.device = jax.local_devices()[0]  # this process's first device (all of them, single-process)

    @property
    def devices(self) -> list[Any]:
        return [self.device] if self.mesh is None else list(self.mesh.devices.flat)

    def replicated(self) -> Sharding:
        """Every device of the placement holds the whole value (the one device without a mesh)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.device)
        return NamedSharding(self.mesh, PartitionSpec())

    def state_sharding(self, slot: StateSlot) -> Sharding:
        del slot  # the plan's placement for this slot goes here
        return self.replicated()

    def batch_sharding(self, slot: BatchSlot) -> Sharding:
        del slot  # data-parallel batches will split along the mesh's data axis here
        return self.replicated()

    def node_sharding(self, node: Any) -> Sharding | None:
        """A sharding constraint for one graph node's value (plan-driven placements override this)."""
        del node
        return None

    def describe(self) -> str:
        if self.mesh is None:
            return f"1 device ({self.device})"
        return f"mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} devices (replicated)"
