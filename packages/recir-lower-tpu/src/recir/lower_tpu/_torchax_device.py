"""Keeps torchax's "jax" device from breaking torch.compile in the same process.

torchax renames torch's PrivateUse1 device to "jax" and its device module says that device is available.
From torch 2.10, torch.compile (Dynamo) asks the available accelerator for its current stream, which the
"jax" device cannot answer ("PyTorch is not linked with support for jax devices"): importing
recir.lower_tpu broke recir.lower_gpu and any torch.compile in the process. RecIR never places tensors on
the "jax" device (it converts tensors to JAX arrays itself), so the device reports itself unavailable.
"""

from __future__ import annotations

import torchax.device_module


def _unavailable() -> bool:
    return False


torchax.device_module.is_available = _unavailable
