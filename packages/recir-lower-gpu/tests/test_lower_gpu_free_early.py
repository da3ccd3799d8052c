"""``GPUOptions.free_early``: with in-place state updates, Inductor frees a buffer after its last reader
instead of keeping every buffer computed from a parameter alive until that parameter's update. Measured
on what the compiled code holds (the bytes of its live buffers, line by line), with the same bits."""

from __future__ import annotations

import sys
from typing import Any

import recir.lower_gpu as lg
import torch
import torch.nn as nn
from _lower_gpu_steps import train_compiled
from recir.capture import capture_train_step
from recir.lower_gpu._free_early import FreeEarly
from recir.transforms import Pipeline, Recompute


class _Blocks(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _batch(seed: int, n: int = 512, width: int = 128) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, width, generator=g), "y": torch.randn(n, 1, generator=g)}


def _recomputed_step() -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(0)
    model = _Blocks()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = capture_train_step(model, opt, _loss, _batch(0))
    step = Pipeline([Recompute(modules=("blocks.*",))], name="t").run(step)
    return model, opt, step


def _peak_live_bytes(compiled: Any, state: Any, batch: Any, cache_dir: str) -> int:
    """The most bytes of Inductor buffers (``bufN`` locals of the compiled ``call``) alive at once."""
    peak = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            storages = {
                v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
                for k, v in frame.f_locals.items()
                if k.startswith("buf") and isinstance(v, torch.Tensor)
            }
            peak[0] = max(peak[0], sum(storages.values()))
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        return local if code.co_name == "call" and code.co_filename.startswith(cache_dir) else None

    sys.settrace(calls)
    try:
        compiled(state, batch)
    finally:
        sys.settrace(None)
    return peak[0]


def test_free_early_frees_forward_buffers_before_the_update_with_the_same_bits(lower_gpu_cache_dir):
    peaks, runs = {}, {}
    for free_early in (False, True):
        model, opt, step = _recomputed_step()
        options = lg.GPUOptions(free_early=free_early, cache_dir=lower_gpu_cache_dir)
        compiled = lg.compile(step, device="cpu", options=options)
        state = compiled.init_state(model, opt)
        peaks[free_early] = _peak_live_bytes(compiled, state, _batch(1), lower_gpu_cache_dir)
        runs[free_early] = train_compiled(compiled, model, opt, [_batch(i) for i in range(3)])
    assert peaks[False] > 0
    # Without it each block's forward products (512 x 256 and 512 x 128 floats) live until the block's
    # Adam update; with it only what the recomputing backward reads is kept.
    assert peaks[True] < 0.75 * peaks[False], peaks
    (state_off, losses_off), (state_on, losses_on) = runs[False], runs[True]
    torch.testing.assert_close(losses_on, losses_off, rtol=0, atol=0)
    for name, value in state_off.items():  # parameters and Adam moments
        torch.testing.assert_close(state_on[name], value, rtol=0, atol=0, msg=name)


def test_free_early_is_an_inductor_pass_only_for_in_place_updates():
    patches = lg.GPUOptions().inductor_patches("cpu")
    assert isinstance(patches["_pre_fusion_custom_pass"], FreeEarly)
    assert patches["_pre_fusion_custom_pass"].uuid()  # keyed by the FX graph cache, not a bypass
    assert "_pre_fusion_custom_pass" not in lg.GPUOptions(free_early=False).inductor_patches("cpu")
    assert "_pre_fusion_custom_pass" not in lg.GPUOptions(in_place=False).inductor_patches("cpu")
