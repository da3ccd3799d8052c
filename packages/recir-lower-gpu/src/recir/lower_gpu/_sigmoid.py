"""``CpuSigmoid``: which exponential Inductor's vectorised C++ sigmoid (and so SiLU, SwishLayerNorm and
their gradients) calls on the CPU.

Inductor writes a vectorised ``sigmoid(x)`` as ``1 / (1 + exp(-x))`` with ``Vectorized::exp()``, a call
of SLEEF's ``expf16_u10`` (at most 1 ULP) out of line for every 16 floats. ``"fast"`` writes
``exp_u20()`` instead: ATen's own inline range reduction and degree-5 polynomial (at most 20 ULP, and
exact zero below float's normal range, where the sigmoid is 1 either way). Over 2M inputs in [-100, 100]
the sigmoid stayed within 3.7e-7 relative of float64's (SLEEF: 1.5e-7), SiLU within 4.1e-7 (1.9e-7). On
DLRMv3's serving model that kernel was 9% of the full-sequence package's time (SLEEF's ``exp``: 8.7-9.1%
in two profiles; 2-core AMD EPYC, AVX-512, one thread); the cached-history candidates package at batch
256 bf16 ran 42.8 -> 40.5 ms (median of 10 alternating rounds), the full-sequence package 106.5 -> 103.2.

Inductor has no hook for how a pointwise op becomes C++, so :func:`sigmoid_codegen` patches
``CppVecOverrides.sigmoid`` for the length of one compile, and ``CpuSigmoid`` itself, installed as
Inductor's ``joint_custom_post_pass``, changes nothing in the graph: its ``uuid`` puts the choice (and
this file) into Inductor's FX-graph and AOTAutograd cache keys, so a cached kernel of the other choice is
never reused. The scalar tail loops keep ``std::exp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

CpuSigmoidMode = Literal["fast", "sleef"]
CPU_SIGMOID_MODES: tuple[str, ...] = ("fast", "sleef")
_SLOT = "joint_custom_post_pass"


class CpuSigmoid(CustomGraphPass):
    """The sigmoid's exponential as an Inductor cache-key carrier (see the module docstring); installed by
    :func:`sigmoid_patches`, read back by :func:`sigmoid_codegen`."""

    def __init__(self, mode: CpuSigmoidMode) -> None:
        self.mode = mode

    def __call__(self, graph: fx.Graph) -> None:
        """Nothing: the choice acts in code generation (:func:`sigmoid_codegen`)."""

    def uuid(self) -> Any:
        return ("recir-cpu-sigmoid", self.mode, get_hash_for_files((__file__,)))


def sigmoid_patches(mode: CpuSigmoidMode) -> dict[str, Any]:
    """The Inductor config patch that selects ``mode`` (``{}`` for SLEEF, Inductor's own choice)."""
    if mode not in CPU_SIGMOID_MODES:
        raise ValueError(f"cpu_sigmoid: expected one of {CPU_SIGMOID_MODES}, got {mode!r}")
    return {} if mode == "sleef" else {_SLOT: CpuSigmoid(mode)}


def _fast_sigmoid(x: str) -> str:
    return f"decltype({x})(1)/(decltype({x})(1) + {x}.neg().exp_u20())"


@contextlib.contextmanager
def sigmoid_codegen(patches: Mapping[str, Any]) -> Iterator[None]:
    """Inductor's vectorised C++ sigmoid as ``patches`` select it (a :class:`CpuSigmoid` in their
    ``joint_custom_post_pass``), for the length of the block; put back after."""
    chosen = patches.get(_SLOT)
    if not isinstance(chosen, CpuSigmoid) or chosen.mode == "sleef":
        yield
        return
    from torch._inductor.codegen.cpp import CppVecOverrides

    saved = CppVecOverrides.__dict__["sigmoid"]
    CppVecOverrides.sigmoid = staticmethod(_fast_sigmoid)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CppVecOverrides.sigmoid = saved  # type: ignore[method-assign]
