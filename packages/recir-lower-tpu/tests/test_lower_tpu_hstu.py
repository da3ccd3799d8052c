"""``recir::hstu_attention`` on the TPU path: the blocked JAX lowerings against the ATen references, and
``TPUOptions(attention_kernel="pallas")`` (the Pallas forward and backward, interpreted on the CPU) in a compiled
step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from recir.lower_tpu import TPUOptions, compile
from recir.lower_tpu._hstu import hstu_attention_backward_blocked, hstu_attention_blocked
from recir.transforms import (
    ConfigError,
    hstu_attention,
    hstu_attention_backward_reference,
    hstu_attention_reference,
)
from torch import nn

pytestmark = pytest.mark.tpu
B, H, N, A, PREFIX, ALPHA = 3, 2, 13, 8, 10, 0.25


def _inputs():
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(B, H, N, A) for _ in range(4))
    history, candidates = torch.tensor([10, 4, 0]), torch.tensor([3, 1, 0])
    valid = torch.cat(
        [torch.arange(PREFIX)[None] < history[:, None], torch.arange(N - PREFIX)[None] < candidates[:, None]],
        1,
    )
    return q, k, v, g, valid, torch.tensor(11.0)


@pytest.mark.parametrize("bounds", [[0, N], [0, 6, N], [0, 4, 10, 11, N]])
def test_lower_tpu_hstu_blocked_equals_the_aten_references(bounds):
    q, k, v, g, valid, scale = _inputs()
    j = [jnp.asarray(t.numpy()) for t in (q, k, v, g, valid, scale)]
    # float32 products at full precision: a TPU's default is one bfloat16 pass (measured on a v5e:
    # 1.3e-3 off the reference), the compiled step's follows torch's (TPUOptions.matmul_precision)
    with jax.default_matmul_precision("highest"):
        out = hstu_attention_blocked(j[0], j[1], j[2], j[4], j[5], PREFIX, ALPHA, bounds)
        grads = hstu_attention_backward_blocked(j[3], j[0], j[1], j[2], j[4], j[5], PREFIX, ALPHA, bounds)
    want = hstu_attention_reference(q, k, v, valid, scale, PREFIX, ALPHA, bounds)
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-6)
    wants = hstu_attention_backward_reference(g, q, k, v, valid, scale, PREFIX, ALPHA, bounds)
    for name, got, w in zip("qkv", grads, wants, strict=True):
        np.testing.assert_allclose(np.asarray(got), w.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"d{name}")


class Attend(nn.Module):
    """Projections around one recir::hstu_attention (the shape of an STU layer's attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(A, 3 * H * A)
        self.out = nn.Linear(H * A, 1)

    def forward(self, x, valid, scale):
        q, k, v = (t.view(B, N, H, A).transpose(1, 2) for t in self.qkv(x).split(H * A, dim=-1))
        attn = hstu_attention(q, k, v, valid, scale, PREFIX, ALPHA, [0, 7, N])
        return self.out(attn.transpose(1, 2).reshape(B, N, H * A)).square().mean()


def _trained(kernel: str | None, steps: int = 3):
    from recir.capture import capture_train_step

    torch.manual_seed(0)
    model = Attend()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _, _, _, _, valid, scale = _inputs()
    batch = {"x": torch.randn(B, N, A), "valid": valid, "scale": scale}
    loss_fn = lambda m, b: m(b["x"], b["valid"], b["scale"])  # noqa: E731
    if kernel is None:  # eager torch: the op's ATen implementation and autograd
        for _ in range(steps):
            opt.zero_grad()
            loss_fn(model, batch).backward()
            opt.step()
        params = {f"param:{n}": p.detach() for n, p in model.named_parameters()}
        moments = {
            f"optim:{n}:{key}": opt.state[p][key]
            for n, p in model.named_parameters()
            for key in ("exp_avg", "exp_avg_sq")
        }
        return params | moments, None
    step = capture_train_step(model, opt, loss_fn, batch)
    compiled = compile(step, options=TPUOptions(attention_kernel=kernel, persistent_cache=False))
    state = compiled.init_state(model, opt)
    for _ in range(steps):
        state, _ = compiled(state, batch)
    return compiled.state_dict(state), compiled


@pytest.mark.parametrize("kernel", ["blocked", "pallas"])
def test_lower_tpu_hstu_attention_step_matches_eager(kernel):
    eager, _ = _trained(None)
    state, compiled = _trained(kernel)
    report = compiled.pipeline.report()
    assert ("recir-tpu-pallas-attention" in report) == (kernel == "pallas")
    record = [r for r in compiled.pipeline.records if r.name == "recir-tpu-pallas-attention"]
    # the forward and its backward both retargeted to the Pallas kernels
    assert [r.stats.get("kernels") for r in record] == ([2] if kernel == "pallas" else []), record
    for name, value in eager.items():  # parameters and Adam's moments
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=2e-5, msg=name)


def test_lower_tpu_bad_attention_kernel():
    with pytest.raises(ConfigError, match="attention_kernel='triton'"):
        TPUOptions(attention_kernel="triton")
