"""fp32 matrix products on the CPU device through oneDNN (``GPUOptions(cpu_matmul=...)``,
``recir-gpu-onednn-matmul``): the step trains like the one that calls ATen's BLAS, and each operand
layout of a training step (``x @ W^T``, ``dY @ W``, ``dY^T @ x``) gives ATen's product."""

from __future__ import annotations

import pytest
import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import mlp_batch, mse_loss, train_compiled
from recir.capture import capture_train_step
from recir.lower_gpu._onednn import MIN_MACS, onednn_available, route_matmuls
from recir.transforms import ConfigError
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 64 x 256 x 512 = 8.4M multiply-adds per product (routed); the 512 -> 1 head stays ATen's
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 1))


def _batch(i: int) -> dict[str, torch.Tensor]:
    return mlp_batch(i, n=64, din=256)


def _train(cpu_matmul: str, cache_dir: str):  # type: ignore[no-untyped-def]
    model = _model()
    # SGD: Adam's update divides by sqrt(v), so a gradient element near zero turns a 1e-7 difference in the
    # summation order into a whole step of lr (seen: 2e-4 apart after 4 steps, both products correct)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = capture_train_step(model, opt, mse_loss, _batch(0))
    compiled = lg.compile(
        step, device="cpu", options=lg.GPUOptions(cache_dir=cache_dir, cpu_matmul=cpu_matmul)
    )
    return compiled, *train_compiled(compiled, model, opt, [_batch(i) for i in range(4)])


def test_onednn_products_train_like_atens(lower_gpu_cache_dir):
    onednn, state, losses = _train("auto", lower_gpu_cache_dir)
    aten, ref_state, ref_losses = _train("aten", lower_gpu_cache_dir)
    record = next(r for r in onednn.pipeline.records if r.name == "recir-gpu-onednn-matmul")
    # forward: 2 addmm; backward: dX of layers 2 and 1... and every dW (dY^T @ x: the transposed form)
    assert record.stats["addmm"] == 2 and record.stats["mm"] >= 3 and record.stats["transposed"] >= 1
    assert record.stats["kept"] >= 1  # the 256 -> 1 head's products are small
    ops = [n.target for n in onednn.step.graph.nodes]
    assert ops.count(torch.ops.recir.cpu_matmul.default) == record.stats["addmm"] + record.stats["mm"]
    assert "recir-gpu-onednn-matmul" not in [r.name for r in aten.pipeline.records]
    assert torch.ops.recir.cpu_matmul.default not in [n.target for n in aten.step.graph.nodes]
    # parameters and momenta, not just the loss
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    assert state.keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["x@Wt", "dY@W", "dYt@x", "slice@W", "col@col"])
def test_each_operand_layout_gives_atens_product(layout):
    g = torch.Generator().manual_seed(1)
    x, w, dy = (torch.randn(*s, generator=g) for s in ((96, 256), (512, 256), (96, 512)))
    wide = torch.randn(96, 768, generator=g)
    a, b = {
        "x@Wt": (x, w.t()),
        "dY@W": (dy, w),
        "dYt@x": (dy.t(), x),  # a column-major: computed as (x^T @ dY)^T, copying the smaller x
        "slice@W": (wide[:, 256:512], w.t()),
        "col@col": (torch.randn(256, 96, generator=g).t(), w.t()),
    }[layout]
    gm = make_fx(lambda a, b: torch.mm(a, b) * 2, tracing_mode="fake")(a, b)
    counts = route_matmuls(gm, min_macs=0)
    assert counts["mm"] == 1
    assert counts["transposed"] == (layout in ("dYt@x", "col@col"))
    torch.testing.assert_close(gm(a, b), torch.mm(a, b) * 2, rtol=1e-5, atol=1e-4)


def test_small_products_and_other_dtypes_keep_aten():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    gm = make_fx(torch.mm, tracing_mode="fake")(a, b)
    assert MIN_MACS > 16 * 32 * 8 and route_matmuls(gm)["kept"] == 1
    half = make_fx(torch.mm, tracing_mode="fake")(a.bfloat16(), b.bfloat16())
    assert route_matmuls(half, min_macs=0) == {"mm": 0, "addmm": 0, "transposed": 0, "kept": 0}


def test_bad_option_names_the_choices():
    with pytest.raises(ConfigError, match="cpu_matmul.*'auto', 'onednn' or 'aten'"):
        lg.GPUOptions(cpu_matmul="mkl")  # type: ignore[arg-type]
