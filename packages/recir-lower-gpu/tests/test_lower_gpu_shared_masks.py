"""Boolean values many kernels read are computed once (``GPUOptions(store_shared_masks=True)``,
``recir-gpu-store-shared-masks``): an attention-style mask built once and read by every layer's
forward and backward goes through ``recir::store``; the step's numbers are the same bits."""

from __future__ import annotations

import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import train_compiled
from recir.capture import capture_train_step
from recir.lower_gpu._store import store_shared_masks
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

N = 300  # 300 x 300 = 90K mask elements per sample: above the 64K threshold


class Masked(nn.Module):
    """Three layers, each multiplying its scores by one causal-and-valid mask built once."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(N)
        valid = pos[None, :] < lengths[:, None]
        mask = (pos[None, :] <= pos[:, None])[None] & valid[:, :, None] & valid[:, None, :]
        for layer in self.layers:
            h = layer(x)
            scores = torch.sigmoid(h @ h.transpose(1, 2)) * mask.to(h.dtype)
            x = x + scores @ h / N
        return x.pow(2).mean()


def _batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"x": torch.randn(2, N, 16, generator=g), "lengths": torch.tensor([N - 7 * i - 1, N // 2])}


def _train(store: bool, cache_dir: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = capture_train_step(model, opt, lambda m, b: m(b["x"], b["lengths"]), _batch(0))
    options = lg.GPUOptions(cache_dir=cache_dir, store_shared_masks=store)
    compiled = lg.compile(step, device="cpu", options=options)
    return compiled, *train_compiled(compiled, model, opt, [_batch(i) for i in range(3)])


def test_a_mask_every_layer_reads_is_stored_once_and_the_numbers_are_the_same(lower_gpu_cache_dir):
    stored, state, losses = _train(True, lower_gpu_cache_dir)
    plain, ref_state, ref_losses = _train(False, lower_gpu_cache_dir)
    record = next(r for r in stored.pipeline.records if r.name == "recir-gpu-store-shared-masks")
    assert record.stats["masks"] == 1
    stores = [n for n in stored.step.graph.nodes if n.target is torch.ops.recir.store.default]
    assert len(stores) == 1 and stores[0].meta["val"].shape == (2, N, N)
    assert "recir-gpu-store-shared-masks" not in [r.name for r in plain.pipeline.records]
    assert torch.equal(losses, ref_losses)
    for name, value in ref_state.items():
        assert torch.equal(state[name], value), name


def test_small_or_rarely_read_booleans_are_left_to_inductor():
    x = torch.randn(N, N)

    def twice(x: torch.Tensor) -> torch.Tensor:
        keep = x > 0  # read by two kernels: recomputing is cheaper than a stored byte per element
        return (x * keep).sum() + (x.exp() * keep).sum()

    def small(x: torch.Tensor) -> torch.Tensor:
        keep = x[:100, :100] > 0  # 10K elements
        return sum((x[:100, :100] * k * keep).sum() for k in range(4))

    for fn in (twice, small):
        gm = make_fx(fn, tracing_mode="fake")(x)
        assert store_shared_masks(gm) == 0, fn.__name__
