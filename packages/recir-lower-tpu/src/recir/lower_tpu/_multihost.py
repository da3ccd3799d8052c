"""Multi-process (multi-host) JAX: one process per host, one global mesh over every process's devices.

``initialize_distributed`` starts ``jax.distributed`` (gloo collectives on CPU hosts); the compiled step
then runs the same SPMD program in every process, each feeding and reading only its own devices' shards.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import jax
import numpy as np
from recir.transforms import ConfigError

logger = logging.getLogger("recir.lower_tpu")

_ENV = {
    "coordinator_address": "JAX_COORDINATOR_ADDRESS",
    "num_processes": "JAX_NUM_PROCESSES",
    "process_id": "JAX_PROCESS_ID",
}


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> tuple[int, int]:
    """Joins this process to a multi-process JAX job; returns ``(process index, process count)``.

    Call it in every process before anything else touches JAX devices. Arguments left ``None`` come from
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, and otherwise from JAX's
    cluster auto-detection (Cloud TPU, SLURM, Open MPI, Kubernetes). On CPU hosts the cross-process
    collectives run over gloo (JAX's default). A second call in an initialised process is a no-op.
    """
    if jax.distributed.is_initialized():
        return jax.process_index(), jax.process_count()
    args: dict[str, Any] = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    for key, env in _ENV.items():
        if args[key] is None and os.environ.get(env):
            raw = os.environ[env]
            if key != "coordinator_address" and not raw.isdigit():
                raise ConfigError(f"{env}={raw!r} is not a non-negative integer. Fix: e.g. {env}=2")
            args[key] = raw if key == "coordinator_address" else int(raw)
    n, pid = args["num_processes"], args["process_id"]
    if n is not None and pid is not None and not 0 <= pid < n:
        raise ConfigError(f"process id {pid} is outside 0..{n - 1} for {n} processes. Fix: pass 0 <= id < N")
    try:
        jax.distributed.initialize(**args)
    except RuntimeError as e:  # e.g. a coordinator that never answers
        raise ConfigError(
            f"jax.distributed.initialize({args}) failed: {e}. Fix: start every process with the same "
            "coordinator address (host:port of process 0) and process count, and distinct process ids."
        ) from e
    logger.info(
        "recir.lower_tpu: process %d of %d, %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return jax.process_index(), jax.process_count()


def host_value(x: jax.Array) -> np.ndarray:
    """The global value of ``x``: this process must hold all of it (or a replica of all of it)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    raise ConfigError(
        f"a {x.shape} array sharded as {x.sharding} spans several processes; this process holds only "
        "part of it. Fix: gather it first (TPUCompiledStep.state_dict does), or read x.addressable_shards."
    )


def gather_to_every_process(arrays: list[jax.Array], replicated: Any) -> list[jax.Array]:
    """``arrays`` replicated on every device (one program, a collective: call it in every process)."""
    jax.block_until_ready(arrays)
    return list(_replicator(replicated)(arrays))


@functools.lru_cache(maxsize=8)
def _replicator(replicated: Any) -> Any:
    return jax.jit(_identity, out_shardings=replicated)


def _identity(xs: Any) -> Any:
    return xs


def sync_processes(name: str) -> None:
    """A barrier across the JAX processes (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
