"""HSTU's jagged target-aware attention kernels (``hstu_attention_pallas`` and its backward,
``hstu_attention_backward_pallas``) against the dense ``[B, N, N]`` mask formulation (the backward against
its gradients through ``jax.vjp``), in Pallas's HLO interpreter (the default off-TPU) and, for one case
each, TPU interpret mode.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from recir.lower_tpu._hstu_pallas import (  # noqa: E402
    _num_key_blocks,
    hstu_attention_dense,
    hstu_attention_pallas,
)
from recir.lower_tpu._hstu_pallas_backward import hstu_attention_backward_pallas  # noqa: E402

pytestmark = pytest.mark.tpu

# N = 21 is no multiple of 8; slots [0, 13) are history, [13, 21) the 8 candidates.
N, PREFIX, H, ALPHA = 21, 13, 2, 0.7
# per sample: (history length L_b, valid candidate count C_b), covering 0 and all of each
LENGTHS = [(0, 3), (13, 0), (5, 8), (9, 2), (0, 0)]


def _valid(lengths: list[tuple[int, int]] = LENGTHS) -> np.ndarray:
    slot = np.arange(N)
    return np.stack([(slot < hist) | ((slot >= PREFIX) & (slot < PREFIX + cand)) for hist, cand in lengths])


def _qkv(dim: int, dtype: jnp.dtype = jnp.float32, seed: int = 0) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.normal(key, (len(LENGTHS), H, N, dim), jnp.float32).astype(dtype) for key in keys]


def _run(q, k, v, valid, scale, **blocks) -> jax.Array:
    """The kernel under ``jax.jit`` with ``scale`` an argument: the normaliser is traced, not a constant.
    float32 products at ``highest``, as the reference's: on a TPU the default is one bf16 pass (measured on
    a v5e: within 3e-3 of the reference, not 1e-5)."""
    fn = jax.jit(lambda q, k, v, m, s: hstu_attention_pallas(q, k, v, m, s, PREFIX, ALPHA, **blocks))
    with jax.default_matmul_precision("highest"):
        return fn(q, k, v, jnp.asarray(valid), scale)


def _kernel_dot_precisions(dtype, setting: str | None) -> set:
    """The precision of every product inside the kernel, traced under ``default_matmul_precision(setting)``."""
    q, k, v = _qkv(16, dtype)
    fn = lambda q, k, v: hstu_attention_pallas(q, k, v, jnp.asarray(_valid()), 21.0, PREFIX, ALPHA)  # noqa: E731
    if setting is None:
        jaxpr = jax.make_jaxpr(fn)(q, k, v)
    else:
        with jax.default_matmul_precision(setting):
            jaxpr = jax.make_jaxpr(fn)(q, k, v)
    found: set = set()

    def walk(jx) -> None:
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                found.add(eqn.params["precision"])
            for value in eqn.params.values():  # pallas_call's kernel, cond branches (pl.when), loop bodies
                for item in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return found


@pytest.mark.parametrize(
    ("dtype", "setting", "want"),
    [
        (jnp.float32, None, "DEFAULT"),
        (jnp.float32, "highest", "HIGHEST"),
        (jnp.float32, "high", "HIGHEST"),  # Mosaic has no three-pass product: rounded up, not refused
        (jnp.bfloat16, "highest", "DEFAULT"),
    ],
)
def test_kernel_products_take_the_traced_matmul_precision(dtype, setting, want) -> None:
    """Mosaic compiles DEFAULT or HIGHEST only; the kernel's products follow TPUOptions.matmul_precision."""
    precisions = _kernel_dot_precisions(dtype, setting)
    assert precisions, "no product found inside the kernel"
    want_p = getattr(jax.lax.Precision, want)
    assert precisions == {(want_p, want_p)}


def _assert_close(out: jax.Array, want: jax.Array, tol: float) -> None:
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol * np.abs(want).max())


@pytest.mark.parametrize(
    ("block_q", "block_k", "dim"),
    [(8, 8, 16), (16, 8, 32), (8, 16, 16), (None, None, 32)],
    ids=["q8-k8", "q16-k8", "q8-k16", "default"],
)
def test_matches_dense_reference(block_q: int | None, block_k: int | None, dim: int) -> None:
    """float32, jagged histories and candidates, N padded to the blocks, several key blocks per row."""
    q, k, v = _qkv(dim)
    valid, scale = _valid(), jnp.float32(N)
    out = _run(q, k, v, valid, scale, block_q=block_q, block_k=block_k)
    want = hstu_attention_dense(q, k, v, jnp.asarray(valid), scale, PREFIX, ALPHA)
    assert out.shape == q.shape and out.dtype == jnp.float32
    _assert_close(out, want, 1e-5)
    # invalid rows are exactly 0; every valid row gets at least its own term
    np.testing.assert_array_equal(np.asarray(out)[~valid[:, None, :].repeat(H, 1)], 0.0)


def test_matches_dense_reference_in_tpu_interpret_mode() -> None:
    """The TPU simulator (SMEM scalar prefetch, VMEM blocks, race detection) gives the same answer."""
    q, k, v = _qkv(16)
    valid, scale = _valid(), jnp.float32(3.0)
    sim = pltpu.InterpretParams(detect_races=True)
    out = _run(q, k, v, valid, scale, block_q=8, block_k=8, interpret=sim)
    _assert_close(out, hstu_attention_dense(q, k, v, jnp.asarray(valid), scale, PREFIX, ALPHA), 1e-5)


def test_bfloat16_within_tolerance() -> None:
    q, k, v = _qkv(32, jnp.bfloat16, seed=1)
    valid, scale = _valid(), jnp.float32(5.0)
    out = _run(q, k, v, valid, scale, block_q=8, block_k=8)
    assert out.dtype == jnp.bfloat16
    _assert_close(out, hstu_attention_dense(q, k, v, jnp.asarray(valid), scale, PREFIX, ALPHA), 2e-2)


def test_padded_keys_never_reach_the_output() -> None:
    """NaN / inf in every invalid slot's k and v (skipped blocks and the padded tail of a partial block):
    the output stays finite and equals the reference on zeros there."""
    q, k, v = _qkv(16, seed=2)
    valid = _valid()
    pad = ~valid[:, None, :, None]
    poisoned_k = jnp.where(pad, jnp.nan, k)
    poisoned_v = jnp.where(pad & (np.arange(16) % 2 == 0), jnp.inf, jnp.where(pad, jnp.nan, v))
    scale = jnp.float32(N)
    out = _run(q, poisoned_k, poisoned_v, valid, scale, block_q=8, block_k=8)
    assert np.isfinite(np.asarray(out)).all()
    zeros_k, zeros_v = jnp.where(pad, 0.0, k), jnp.where(pad, 0.0, v)
    _assert_close(
        out, hstu_attention_dense(q, zeros_k, zeros_v, jnp.asarray(valid), scale, PREFIX, ALPHA), 1e-5
    )


def _dense_grads(q, k, v, valid, scale, g) -> tuple[jax.Array, ...]:
    """(dq, dk, dv) of the dense formulation for the output gradient ``g``, float32 products at highest; zero
    at invalid rows (the kernels' rows that get no gradient)."""
    with jax.default_matmul_precision("highest"):
        _, vjp = jax.vjp(
            lambda q, k, v: hstu_attention_dense(q, k, v, jnp.asarray(valid), scale, PREFIX, ALPHA), q, k, v
        )
        grads = vjp(g)
    keep = jnp.asarray(valid)[:, None, :, None]
    return tuple(jnp.where(keep, x, 0) for x in grads)


def _run_backward(g, q, k, v, valid, scale, **blocks) -> tuple[jax.Array, ...]:
    fn = jax.jit(
        lambda g, q, k, v, m, s: hstu_attention_backward_pallas(g, q, k, v, m, s, PREFIX, ALPHA, **blocks)
    )
    with jax.default_matmul_precision("highest"):
        return fn(g, q, k, v, jnp.asarray(valid), scale)


@pytest.mark.parametrize(
    ("block_q", "block_k", "dim"),
    [(8, 8, 16), (16, 8, 32), (8, 16, 16), (None, None, 32)],
    ids=["q8-k8", "q16-k8", "q8-k16", "default"],
)
def test_backward_matches_the_dense_gradients(block_q: int | None, block_k: int | None, dim: int) -> None:
    """float32 (dq, dk, dv), jagged histories and candidates, several blocks each way; invalid rows get 0."""
    q, k, v = _qkv(dim)
    g = _qkv(dim, seed=5)[0]
    valid, scale = _valid(), jnp.float32(N)
    got = _run_backward(g, q, k, v, valid, scale, block_q=block_q, block_k=block_k)
    for name, out, want in zip(("dq", "dk", "dv"), got, _dense_grads(q, k, v, valid, scale, g)):
        assert out.shape == q.shape and out.dtype == jnp.float32, name
        _assert_close(out, want, 1e-5)


def test_backward_in_tpu_interpret_mode_and_with_poisoned_padding() -> None:
    """The TPU simulator (race detection on), with NaN and inf in every invalid slot of q, k, v and the
    incoming gradient: finite gradients, equal to the dense ones on zeros there."""
    q, k, v = _qkv(16, seed=2)
    g = _qkv(16, seed=6)[0]
    valid = _valid()
    pad = ~valid[:, None, :, None]
    poisoned = [jnp.where(pad, jnp.nan if i % 2 else jnp.inf, x) for i, x in enumerate((g, q, k, v))]
    sim = pltpu.InterpretParams(detect_races=True)
    got = _run_backward(*poisoned, valid, jnp.float32(3.0), block_q=8, block_k=8, interpret=sim)
    zeros = [jnp.where(pad, 0.0, x) for x in (q, k, v)]
    for out, want in zip(got, _dense_grads(*zeros, valid, jnp.float32(3.0), jnp.where(pad, 0.0, g))):
        assert np.isfinite(np.asarray(out)).all()
        _assert_close(out, want, 1e-5)


def test_backward_bfloat16_within_tolerance() -> None:
    q, k, v = _qkv(32, jnp.bfloat16, seed=1)
    g = _qkv(32, jnp.bfloat16, seed=7)[0]
    valid, scale = _valid(), jnp.float32(5.0)
    got = _run_backward(g, q, k, v, valid, scale, block_q=8, block_k=8)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, g)]
    for out, want in zip(got, _dense_grads(*f32[:3], valid, scale, f32[3])):
        assert out.dtype == jnp.bfloat16
        _assert_close(out, want, 3e-2)


@pytest.mark.parametrize("block_k", [8, 16])
def test_key_loop_reads_exactly_the_blocks_with_visible_keys(block_k: int) -> None:
    """The skip bound: every history key ``j < min(q_end, L_b)`` lies in a read block, and the last
    read block holds at least one such key (no block that is only padding or future keys)."""
    for q_end in range(8, 33, 8):
        for hist in range(0, 25):
            visible = min(q_end, hist)
            blocks = int(_num_key_blocks(q_end, hist, block_k))
            assert blocks * block_k >= visible, (q_end, hist)
            assert blocks == 0 if visible == 0 else (blocks - 1) * block_k < visible, (q_end, hist)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefix": 0}, r"prefix must satisfy 0 < prefix <= N = 21, got 0"),
        ({"prefix": N + 1}, r"prefix must satisfy 0 < prefix <= N = 21, got 22"),
        ({"block_q": 12}, r"block_q must be a positive multiple of 8.*got 12"),
        ({"block_k": 0}, r"block_k must be a positive multiple of 8.*got 0"),
    ],
    ids=["prefix-0", "prefix-past-N", "block_q-12", "block_k-0"],
)
def test_invalid_arguments_raise(kwargs: dict[str, int], match: str) -> None:
    q, k, v = _qkv(16)
    args = {"prefix": PREFIX, "alpha": ALPHA, **kwargs}
    with pytest.raises(ValueError, match=match):
        hstu_attention_pallas(q, k, v, jnp.asarray(_valid()), jnp.float32(1.0), **args)


def test_mismatched_shapes_raise() -> None:
    q, k, v = _qkv(16)
    with pytest.raises(ValueError, match=r"q, k, v must all be \[B, H, N, A\]"):
        hstu_attention_pallas(q, k[..., :8], v, jnp.asarray(_valid()), jnp.float32(1.0), PREFIX, ALPHA)
    with pytest.raises(ValueError, match=r"valid must be \[B, N\]"):
        hstu_attention_pallas(q, k, v, jnp.asarray(_valid())[:, :-1], jnp.float32(1.0), PREFIX, ALPHA)


def test_dense_reference_is_the_stated_maths() -> None:
    """The reference against a loop over (b, h, i, j) spelling out ``allowed(i, j)`` term by term."""
    q, k, v = (np.asarray(x, np.float64) for x in _qkv(16, seed=3))
    valid, scale = _valid(), 4.0
    want = np.zeros_like(q)
    for b, h, i, j in np.ndindex(len(LENGTHS), H, N, N):
        if valid[b, i] and valid[b, j] and ((j < PREFIX and j < i) or j == i):
            s = ALPHA * q[b, h, i] @ k[b, h, j]
            want[b, h, i] += s / (1 + np.exp(-s)) / scale * v[b, h, j]
    out = hstu_attention_dense(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), jnp.asarray(valid), scale, PREFIX, ALPHA
    )
    _assert_close(out, want, 1e-5)
