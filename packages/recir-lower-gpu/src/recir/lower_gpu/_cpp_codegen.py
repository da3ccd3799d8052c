"""``CpuCodegen``: two choices of how Inductor's vectorised C++ kernels compute on the CPU, which Inductor
has no option for.

**The sigmoid's exponential** (``cpu_sigmoid``; SiLU, SwishLayerNorm and their gradients). Inductor writes
a vectorised ``sigmoid(x)`` as ``1 / (1 + exp(-x))`` with ``Vectorized::exp()``, a call of SLEEF's
``expf16_u10`` (at most 1 ULP) out of line for every 16 floats. ``"fast"`` computes the exponential inline.
Where the kernels build for AVX-512 it is :func:`_scalef_sigmoid`'s: range reduction in two parts, a degree-5
polynomial and ``vscalefps`` (13 instructions per 16 floats against ``exp_u20``'s 19). Over 2M inputs in
[-100, 100] the sigmoid stays within 2.6e-7 relative of float64's wherever that is a normal float (SLEEF:
1.5e-7). Elsewhere it is ATen's ``exp_u20`` (range reduction and a degree-5 polynomial, 4.1e-7), whose
input clamp turns NaN into a number (sigmoid(NaN) came out 0, hiding a diverged value from anything that
looks for NaN downstream), so NaN is put back with one blend. On DLRMv3's serving
model the SLEEF kernel was 9% of the full-sequence package's time (8.7-9.1% in two profiles; 2-core AMD
EPYC, AVX-512, one thread); ``exp_u20`` took the cached-history candidates package at batch 256 bf16 from
42.8 to 40.5 ms (median of 10 alternating rounds) and the full-sequence package from 106.5 to 103.2.
``vscalefps`` took the attention's score kernel (``[512, 194, 130]`` bf16, the serving model's first layer)
from 10.26 to 9.86 ms alone, the cached-history candidates package at batch 256 bf16 from 40.15 to 39.39 and
40.28 to 39.21 ms (medians of 10 alternating rounds, two runs) and left the full-sequence package where it was
(96.0 / 96.5 ms). The scalar tail loops keep ``std::exp``.

**float32 -> bfloat16 conversion** (``cpu_bf16``). ATen's ``at::vec`` rounds in integer arithmetic (shift,
mask, add the rounding bias, NaN blend, pack: about 14 instructions per 32 values) even where the CPU
has avx512_bf16's ``vcvtne2ps2bf16``, which does it in one. ``"native"`` writes that instruction (through
``_mm512_cvtne2ps_pbh``) whenever Inductor's kernels build with the extension on (an AVX-512 CPU that has
it, where torch's C++ builder passes ``-march=native``); elsewhere the kernels keep ATen's. Both round to
nearest even, so every normal value converts to the same bits; the instruction flushes float32
subnormals (below 1.2e-38) to zero where ATen keeps them as bf16 subnormals. DLRMv3's full-sequence
serving package, batch 256 bf16 (2-core AMD EPYC with avx512_bf16, one thread, 10 alternating rounds):
median 103.2 -> 100.5 ms.

Inductor has no hook for how an op becomes C++, so :func:`cpp_codegen` patches ``CppVecOverrides.sigmoid``
and ``CppVecKernel.get_to_dtype_expr`` for the length of one compile and puts them back. ``CpuCodegen``
itself, installed as Inductor's ``joint_custom_post_pass``, changes nothing in the graph: its ``uuid`` puts
the choices (and this file) into Inductor's FX-graph and AOTAutograd cache keys, so a cached kernel of
other choices is never reused.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

CpuSigmoidMode = Literal["fast", "sleef"]
CPU_SIGMOID_MODES: tuple[str, ...] = ("fast", "sleef")
CpuBf16Mode = Literal["native", "aten"]
CPU_BF16_MODES: tuple[str, ...] = ("native", "aten")
_SLOT = "joint_custom_post_pass"


class CpuCodegen(CustomGraphPass):
    """The choices as an Inductor cache-key carrier (see the module docstring); installed by
    :func:`codegen_patches`, read back by :func:`cpp_codegen`."""

    def __init__(self, sigmoid: CpuSigmoidMode, bf16: CpuBf16Mode) -> None:
        self.sigmoid, self.bf16 = sigmoid, bf16

    def __call__(self, graph: fx.Graph) -> None:
        """Nothing: the choices act in code generation (:func:`cpp_codegen`)."""

    def uuid(self) -> Any:
        return ("recir-cpu-codegen", self.sigmoid, self.bf16, get_hash_for_files((__file__,)))


def codegen_patches(sigmoid: CpuSigmoidMode, bf16: CpuBf16Mode) -> dict[str, Any]:
    """The Inductor config patch that selects the choices (``{}`` for Inductor's own: SLEEF and ATen)."""
    if sigmoid not in CPU_SIGMOID_MODES:
        raise ValueError(f"cpu_sigmoid: expected one of {CPU_SIGMOID_MODES}, got {sigmoid!r}")
    if bf16 not in CPU_BF16_MODES:
        raise ValueError(f"cpu_bf16: expected one of {CPU_BF16_MODES}, got {bf16!r}")
    if (sigmoid, bf16) == ("sleef", "aten"):
        return {}
    return {_SLOT: CpuCodegen(sigmoid, bf16)}


#: exp(r) on [-ln(2)/2, ln(2)/2], degree 5, fitted for the least largest relative error (7.5e-8; 2.3e-7 in
#: float32's Horner), lowest order first.
_EXP_POLY = ("1.0000001192092896f", "0.9999997019767761f", "0.49998894333839417f", "0.16667574644088745f",
             "0.04191538318991661f", "0.008297654800117016f")  # fmt: skip


def _scalef_sigmoid(x: str) -> str:
    """``1 / (1 + exp(-x))`` per 16 floats on AVX-512F: ``-x`` clamped to [-150, 150] (NaN passes: the
    instructions return their second operand on a NaN), ``n = round(-x log2 e)``, ``r = -x - n ln 2`` in two
    parts (Cody and Waite, so ``r`` is exact to float's precision at any ``n``), :data:`_EXP_POLY` at ``r``,
    scaled by ``2^n`` in one ``vscalefps`` (0 below float's range, inf above)."""
    c = _EXP_POLY
    horner = f"_mm512_set1_ps({c[5]})"
    for k in range(4, -1, -1):
        horner = f"_mm512_fmadd_ps({horner}, r_, _mm512_set1_ps({c[k]}))"
    return (
        f"([](auto v_) {{ static_assert(sizeof(v_) % sizeof(__m512) == 0); decltype(v_) e_; "
        f"for (int i_ = 0; i_ < int(sizeof(v_) / sizeof(__m512)); i_++) {{ "
        f"__m512 z_ = _mm512_max_ps(_mm512_set1_ps(-150.0f), _mm512_min_ps(_mm512_set1_ps(150.0f), "
        f"_mm512_sub_ps(_mm512_setzero_ps(), reinterpret_cast<const __m512*>(&v_)[i_]))); "
        f"__m512 n_ = _mm512_roundscale_ps(_mm512_mul_ps(z_, _mm512_set1_ps(1.44269504088896341f)), "
        f"_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); "
        f"__m512 r_ = _mm512_fnmadd_ps(n_, _mm512_set1_ps(0.693359375f), z_); "
        f"r_ = _mm512_fnmadd_ps(n_, _mm512_set1_ps(-2.12194440e-4f), r_); "
        f"reinterpret_cast<__m512*>(&e_)[i_] = _mm512_scalef_ps({horner}, n_); }} "
        f"return decltype(v_)(1) / (decltype(v_)(1) + e_); }})({x})"
    )


def _fast_sigmoid(avx512: Callable[[], bool]) -> Callable[[Any], str]:
    """``CppVecOverrides.sigmoid`` for ``"fast"``: :func:`_scalef_sigmoid` for float32 vectors where the
    kernels build for AVX-512 (``avx512()``, asked at the first sigmoid of a compile); elsewhere ATen's
    ``exp_u20``, whose clamp turns NaN into a number, with NaN put back (``isnan``, one blend)."""

    def sigmoid(x: Any) -> str:
        if getattr(x, "dtype", None) == torch.float32 and avx512():
            return _scalef_sigmoid(x)
        t = f"decltype({x})"
        return f"{t}::blendv({t}(1)/({t}(1) + {x}.neg().exp_u20()), {x}, {x}.isnan())"

    return sigmoid


def _native_bf16(original: Any) -> Any:
    """``CppVecKernel.get_to_dtype_expr`` writing 32-lane float32 -> bf16 vector conversions as avx512_bf16's
    instruction (``_mm512_cvtne2ps_pbh``), any other conversion as ``original`` does. The ISA is asked at
    the first conversion, once Inductor has picked it, then remembered for this compile."""
    able = functools.cache(_builds_avx512_bf16)

    def get_to_dtype_expr(self: Any, src: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> str:
        # 32 lanes: two float vectors become one of bf16 (a kernel with bf16 in it tiles by 32; others,
        # e.g. 64 lanes beside int8, keep ATen's conversion)
        if (
            src.is_vec
            and (src_dtype, dtype) == (torch.float32, torch.bfloat16)
            and (self._get_num_vectors(torch.float32), self._get_num_vectors(torch.bfloat16)) == (2, 1)
            and able()
        ):
            return f"at::vec::Vectorized<at::BFloat16>((__m512i)_mm512_cvtne2ps_pbh({src}[1], {src}[0]))"
        return original(self, src, dtype, src_dtype)

    return get_to_dtype_expr


def _builds_avx512() -> bool:
    """Whether Inductor's CPU kernels build for AVX-512 (its ISA probe's pick, 512 bits wide)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    return bool(isa) and isa.bit_width() == 512


def _builds_avx512_bf16() -> bool:
    """Whether Inductor's CPU kernels build for AVX-512 with avx512_bf16 on: its ISA probe found the CPU
    and the compiler able (``is_avx512_bf16_supported``), and the build turns the extension on, by the
    ISA's flags or by the ``-march=native`` torch's C++ builder gives every x86 kernel outside fbcode
    (Inductor's AVX-512 VNNI choice, what a Zen 4 EPYC gets, leaves ``-mavx512bf16`` out of its flags)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    if not isa or isa.bit_width() != 512 or not getattr(isa, "is_avx512_bf16_supported", lambda: False)():
        return False
    native = sys.platform.startswith("linux") and platform.machine() == "x86_64" and not config.is_fbcode()
    return native or "-mavx512bf16" in isa.build_arch_flags()


@contextlib.contextmanager
def cpp_codegen(patches: Mapping[str, Any]) -> Iterator[None]:
    """Inductor's vectorised C++ as ``patches`` select it (a :class:`CpuCodegen` in their
    ``joint_custom_post_pass``), for the length of the block; put back after."""
    chosen = patches.get(_SLOT)
    if not isinstance(chosen, CpuCodegen):
        yield
        return
    from torch._inductor.codegen.cpp import CppVecKernel, CppVecOverrides

    saved_sigmoid = CppVecOverrides.__dict__["sigmoid"]
    saved_convert = CppVecKernel.__dict__["get_to_dtype_expr"]
    if chosen.sigmoid == "fast":
        CppVecOverrides.sigmoid = staticmethod(_fast_sigmoid(functools.cache(_builds_avx512)))  # type: ignore[method-assign,assignment]
    if chosen.bf16 == "native":
        CppVecKernel.get_to_dtype_expr = _native_bf16(saved_convert)  # type: ignore[method-assign]
    try:
        yield
    finally:
        CppVecOverrides.sigmoid = saved_sigmoid  # type: ignore[method-assign]
        CppVecKernel.get_to_dtype_expr = saved_convert  # type: ignore[method-assign]
