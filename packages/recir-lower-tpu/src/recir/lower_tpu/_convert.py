"""Host torch tensors <-> JAX arrays at the step boundary (batches in, outputs and state out)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Sharding
from recir.transforms import ConfigError, StepGraph
from torchax.ops.mappings import t2j_dtype

from ._multihost import host_value


def jax_dtype(dtype: torch.dtype) -> Any:
    """The JAX dtype a torch dtype becomes here (int64 -> int32 unless x64 is on)."""
    return jax.dtypes.canonicalize_dtype(t2j_dtype(dtype))


def to_jax(t: torch.Tensor, sharding: Sharding, owned: bool = False) -> jax.Array:
    """A torch tensor on ``sharding``'s devices, in its canonical JAX dtype. On the CPU backend JAX may
    share the tensor's memory instead of copying (fine for a batch); ``owned``: always a buffer of JAX's
    own, which a step that donates it can update in place. (A shared buffer cannot be donated: the
    step's first call then allocated all of its state anew, twice the state's memory at its peak.)"""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        host = t.view(torch.int16).numpy().view(jnp.bfloat16)
    else:
        host = t.numpy()
    target = jax_dtype(t.dtype)
    if host.dtype != target:
        host = host.astype(target)
    x = jax.device_put(host, sharding)
    # jax 0.10 shares an aligned host array's memory whatever may_alias says; copying the JAX array does not
    return jax.device_put(x, sharding, may_alias=False) if owned else x


def to_torch(x: jax.Array, dtype: torch.dtype) -> torch.Tensor:
    """A host torch tensor (a copy) with ``dtype`` from a JAX array (gathered when it spans processes)."""
    host = np.array(host_value(x))
    if host.dtype == jnp.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16).to(dtype)
    return torch.from_numpy(host).to(dtype)


def check_state_count(step: StepGraph, state: Sequence[Any]) -> None:
    """ConfigError unless ``state`` has one value per state slot of ``step``."""
    n = len(step.signature.state)
    if len(state) != n:
        raise ConfigError(
            f"expected {n} state arrays (signature order), got {len(state)}. "
            "Fix: build state with compiled.init_state(model, optimizer) and pass the returned state on."
        )
