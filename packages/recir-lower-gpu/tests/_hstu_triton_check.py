"""Run by test_lower_gpu_hstu_triton.py in a fresh process with ``TRITON_INTERPRET=1``: RecIR's Triton HSTU
attention kernels against the ATen references (values and gradients). Prints ``ok <case>`` per case and
exits non-zero with the first mismatch."""

from __future__ import annotations

import os

import torch
from recir.lower_gpu._hstu_triton import hstu_attention_backward_triton, hstu_attention_triton
from recir.transforms import hstu_attention_backward_reference, hstu_attention_reference

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (see the test)"


def _case(B, H, N, A, prefix, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, A, generator=g).to(dtype) for _ in range(3))
    slots = torch.arange(N)[None, :]
    history = torch.randint(prefix // 2, prefix + 1, (B, 1), generator=g)  # padded history tails
    history[0] = min(prefix, 5)  # shorter than a block: the kernels skip the blocks past it
    valid = torch.where(slots < prefix, slots < history, torch.rand(B, N, generator=g) < 0.8)
    return q, k, v, valid, torch.tensor(float(N), dtype=dtype), 1.0 / A**0.5


def float32_case(B, H, N, A, prefix):
    q, k, v, valid, scale, alpha = _case(B, H, N, A, prefix, torch.float32)
    bounds = [0, N]
    grad = torch.randn(B, H, N, A, generator=torch.Generator().manual_seed(1))
    got = hstu_attention_triton(q, k, v, valid, scale, prefix, alpha)
    torch.testing.assert_close(
        got, hstu_attention_reference(q, k, v, valid, scale, prefix, alpha, bounds), rtol=1e-5, atol=1e-6
    )
    expected = hstu_attention_backward_reference(grad, q, k, v, valid, scale, prefix, alpha, bounds)
    for name, a, b in zip(
        "qkv",
        hstu_attention_backward_triton(grad, q, k, v, valid, scale, prefix, alpha),
        expected,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"d{name}: {m}")
    assert bool((got[~valid[:, None, :, None].expand_as(got)] == 0).all()), "padded rows must be exact zeros"


def float16_case():
    """float16 inputs: the kernels accumulate in float32, so against float64's values they are no further
    off than the reference computed in float16 (and within 2e-3 of the largest value)."""
    B, H, N, A, prefix = 2, 2, 90, 32, 80
    q, k, v, valid, scale, alpha = _case(B, H, N, A, prefix, torch.float16)
    grad = torch.randn(B, H, N, A, generator=torch.Generator().manual_seed(1)).half()
    bounds = [0, N]
    exact = [
        hstu_attention_reference(
            *(t.double() for t in (q, k, v)), valid, scale.double(), prefix, alpha, bounds
        )
    ]
    exact += hstu_attention_backward_reference(
        *(t.double() for t in (grad, q, k, v)), valid, scale.double(), prefix, alpha, bounds
    )
    half = [hstu_attention_reference(q, k, v, valid, scale, prefix, alpha, bounds)]
    half += hstu_attention_backward_reference(grad, q, k, v, valid, scale, prefix, alpha, bounds)
    got = [hstu_attention_triton(q, k, v, valid, scale, prefix, alpha)]
    got += hstu_attention_backward_triton(grad, q, k, v, valid, scale, prefix, alpha)
    for name, g, h, e in zip(["out", "dq", "dk", "dv"], got, half, exact):
        err, ref_err = float((g.double() - e).abs().max()), float((h.double() - e).abs().max())
        assert err <= max(ref_err, 2e-3 * float(e.abs().max())), (name, err, ref_err)


if __name__ == "__main__":
    for shape, name in [
        ((2, 2, 40, 16, 30), "candidates"),
        ((3, 2, 150, 32, 131), "more-blocks-than-one"),
        ((2, 1, 70, 24, 70), "no-candidates-odd-head-dim"),
    ]:
        float32_case(*shape)
        print("ok float32", name)
    float16_case()
    print("ok float16")
