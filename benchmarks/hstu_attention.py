"""HSTU attention forward + backward on the TPU path's kernels: the blocked JAX formulation against the Pallas
kernels (``TPUOptions(attention_kernel="pallas")``), at full-size DLRMv3 attention shapes, on whatever JAX
backend this runs on (a TPU: compiled Mosaic; elsewhere Pallas's interpreter, for a smoke run only).

Prints ms per call (median of ``--rounds`` rounds of ``--calls`` calls after a compile) for the forward
alone and forward + backward, each kernel's ratio to the blocked formulation, and the largest difference
of the Pallas gradients from the blocked ones.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--uih", type=int, default=1024, help="history slots (contextual included: +2)")
    p.add_argument("--candidates", type=int, default=10)
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--fill", type=float, default=0.75, help="mean fraction of each history that is real")
    p.add_argument("--block_q", type=int, default=None, help="the Pallas kernels' query block (default 128)")
    p.add_argument("--block_k", type=int, default=None, help="the Pallas kernels' key block (default 128)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=10)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from recir.lower_tpu._hstu import hstu_attention_backward_blocked, hstu_attention_blocked
    from recir.lower_tpu._hstu_pallas import hstu_attention_pallas
    from recir.lower_tpu._hstu_pallas_backward import hstu_attention_backward_pallas

    B, H, A = args.batch, args.heads, args.dim
    prefix = args.uih + 2
    n = prefix + args.candidates
    rng = np.random.default_rng(0)
    hist = np.clip(rng.normal(args.fill * prefix, 0.15 * prefix, B), 2, prefix).astype(int)
    cands = rng.integers(1, args.candidates + 1, B)
    slot = np.arange(n)
    valid = jnp.asarray(
        np.stack([(slot < h) | ((slot >= prefix) & (slot < prefix + c)) for h, c in zip(hist, cands)])
    )
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, g = (jax.random.normal(key, (B, H, n, A), jnp.float32).astype(dtype) for key in keys)
    scale, alpha = jnp.float32(n), 1.0 / A**0.5
    bounds = [0, n // 2, n] if n >= 512 else [0, n]  # DLRMv3's two row blocks from 512 slots

    def blocked_fwd(q, k, v, s):
        return hstu_attention_blocked(q, k, v, valid, s.astype(q.dtype), prefix, alpha, bounds)

    def blocked_both(q, k, v, g, s):
        out = blocked_fwd(q, k, v, s)
        return out, hstu_attention_backward_blocked(
            g, q, k, v, valid, s.astype(q.dtype), prefix, alpha, bounds
        )

    blocks = {"block_q": args.block_q, "block_k": args.block_k}

    def pallas_fwd(q, k, v, s):
        return hstu_attention_pallas(q, k, v, valid, s, prefix, alpha, **blocks)

    def pallas_both(q, k, v, g, s):
        grads = hstu_attention_backward_pallas(g, q, k, v, valid, s, prefix, alpha, **blocks)
        return pallas_fwd(q, k, v, s), grads

    def mixed_both(q, k, v, g, s):  # the Pallas forward with the blocked backward (session 47's "pallas")
        return pallas_fwd(q, k, v, s), blocked_both(q, k, v, g, s)[1]

    def timed(fn, *xs) -> float:
        f = jax.jit(fn)
        jax.block_until_ready(f(*xs))
        rounds = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for _ in range(args.calls):
                out = f(*xs)
            jax.block_until_ready(out)
            rounds.append((time.perf_counter() - t) / args.calls * 1000)
        return statistics.median(rounds)

    print(
        f"backend {jax.default_backend()}, B {B}, H {H}, N {n} (prefix {prefix}), A {A}, {args.dtype}, "
        f"history fill {hist.mean() / prefix:.2f}; Pallas blocks q {args.block_q or 128}, k {args.block_k or 128}; "
        f"ms per call, median of {args.rounds} x {args.calls}"
    )
    base_f = timed(blocked_fwd, q, k, v, scale)
    base_b = timed(blocked_both, q, k, v, g, scale)
    print(f"blocked                   forward {base_f:8.3f}   forward+backward {base_b:8.3f}")
    pf = timed(pallas_fwd, q, k, v, scale)
    mb = timed(mixed_both, q, k, v, g, scale)
    pb = timed(pallas_both, q, k, v, g, scale)
    print(
        f"pallas forward            forward {pf:8.3f} ({base_f / pf:.2f}x)   forward+backward {mb:8.3f} ({base_b / mb:.2f}x)"
    )
    print(
        f"pallas forward+backward                             forward+backward {pb:8.3f} ({base_b / pb:.2f}x)"
    )
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(blocked_both)(q, k, v, g, scale)[1]
        got = jax.jit(pallas_both)(q, k, v, g, scale)[1]
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        print(
            f"{name}: max |pallas - blocked| {np.abs(a - b).max():.3e} (max |blocked| {np.abs(b).max():.3e})"
        )


if __name__ == "__main__":
    main()
