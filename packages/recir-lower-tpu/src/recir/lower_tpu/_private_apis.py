"""Every private torch/torchax API recir.lower_tpu uses, and the versions it was checked against.

`compile` checks the list once per process (recir.transforms.require_private_apis): an installation
without one of them gets one LoweringError naming it. A test keeps the list complete (every `torch._*`
and `torchax.*` module the package imports is listed). JAX is used through public modules only
(`jax.experimental` included).
"""

from __future__ import annotations

from recir.transforms import require_private_apis

# oldest, the lock, newest (nox sessions of the same names)
CHECKED = {
    "torch": ("2.9.1", "2.10.0", "2.12.1"),
    "jax": ("0.10.0", "0.10.2", "0.12.0.1"),
    "torchax": ("0.0.13",),
}

PRIVATE_APIS = (
    "torch._ops:OpOverload",
    "torch._ops:OpOverloadPacket",
    "torch._library.custom_ops:OPDEFS",  # recir::* ops' reference implementations
    "torchax.tensor:Environment",  # RecIR's lowerings go into a private Environment
    "torchax.tensor:OperatorNotFound",
    "torchax.ops.mappings:t2j_dtype",
    "torchax.device_module:is_available",  # replaced: the "jax" device reports itself unavailable
)


def check_private_apis() -> None:
    """LoweringError if this installation lacks one of PRIVATE_APIS (checked once per process)."""
    require_private_apis("recir.lower_tpu", PRIVATE_APIS, CHECKED)
