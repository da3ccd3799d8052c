"""A 32-bit integer mixer in int64 ATen ops: the hash behind recir's counter-based random numbers.

recir-capture's dropout uniforms and recir-embedding's stochastic rounding of low-precision tables both
draw their bits from it. Every value stays below ``2**59`` (multipliers under ``2**27`` on 32-bit values),
so no backend overflows a signed int64 and each computes the same bits (Inductor's C++, XLA, ATen).
"""

from __future__ import annotations

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27: a product with a 32-bit value stays below 2**59 in int64


def mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer mixer on int64 tensors holding values in ``[0, 2**32)``."""
    x = (torch.bitwise_xor(x >> 16, x) * _MUL) & _M32
    x = (torch.bitwise_xor(x >> 16, x) * _MUL) & _M32
    return torch.bitwise_xor(x >> 16, x)
