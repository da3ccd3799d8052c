"""The CPU sigmoid's exponential (recir.lower_gpu._cpp_codegen, ``GPUOptions.cpu_sigmoid``): ``fast`` writes
ATen's inline ``exp_u20`` into Inductor's vectorised sigmoid, ``sleef`` keeps Inductor's SLEEF call; both
train as eager torch.optim does, and the choice is part of Inductor's cache keys."""

from __future__ import annotations

import zipfile

import pytest
import recir.lower_gpu as lg
import torch
import torch.nn.functional as F
from _lower_gpu_steps import assert_states_match_eager_sgd, kernel_files, kernel_source, train_sgd_compiled
from recir.transforms import ConfigError
from torch import nn

_FAST = "exp_u20()"
_SLEEF = ".neg().exp())"  # Inductor's own vectorised sigmoid: 1 / (1 + exp(-x))


class _SiluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.fc1(x))
        return self.fc2(h * torch.sigmoid(h))


def test_compiled_step_sigmoid_exp_follows_the_option_and_matches_eager(tmp_path):
    """Forward and backward sigmoids (SiLU, its gradient) use `exp_u20` with `fast` and SLEEF's `exp` with
    `sleef`; both give torch.optim's parameters and momenta after 5 steps."""
    torch.manual_seed(0)
    model = _SiluMLP()
    states = {}
    for mode in ("fast", "sleef"):
        cache = tmp_path / mode
        states[mode] = train_sgd_compiled(model, lg.GPUOptions(cache_dir=str(cache), cpu_sigmoid=mode), n=32)  # type: ignore[arg-type]
        code = kernel_source(kernel_files(cache))
        assert (_FAST in code, _SLEEF in code) == (mode == "fast", mode == "sleef"), mode
    assert_states_match_eager_sgd(model, _SiluMLP(), states, n=32, rtol=1e-5, atol=1e-6)


def test_the_choice_is_in_inductors_cache_key(tmp_path):
    """One cache folder, the same step compiled `fast` then `sleef`: the second compile generates its own
    kernels (SLEEF's call), it does not reuse the first's from the FX-graph or AOTAutograd cache."""
    torch.manual_seed(0)
    model = _SiluMLP()
    train_sgd_compiled(model, lg.GPUOptions(cache_dir=str(tmp_path), cpu_sigmoid="fast"), n=32)
    first = kernel_files(tmp_path)
    assert _FAST in kernel_source(first) and _SLEEF not in kernel_source(first)
    train_sgd_compiled(model, lg.GPUOptions(cache_dir=str(tmp_path), cpu_sigmoid="sleef"), n=32)
    assert _SLEEF in kernel_source(kernel_files(tmp_path) - first)


@pytest.mark.parametrize("mode", ["fast", "sleef"])
def test_cpu_packages_sigmoid_exp_follows_the_option(tmp_path, mode):
    """`package` (what `export` calls) on the CPU: the sigmoid's exponential as chosen, the model's values."""
    torch.manual_seed(0)
    model, x = _SiluMLP().eval(), torch.randn(64, 8)
    program = torch.export.export(model, (x,)).run_decompositions()
    path = lg.package(program, tmp_path / "silu.pt2", cpu_sigmoid=mode)  # type: ignore[arg-type]
    with zipfile.ZipFile(path) as z:
        code = "".join(z.read(f).decode() for f in z.namelist() if f.endswith(".cpp"))
    assert (_FAST in code, _SLEEF in code) == (mode == "fast", mode == "sleef")
    got = torch._inductor.aoti_load_package(str(path))(x)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)


def test_bad_cpu_sigmoid_names_the_choices():
    with pytest.raises(ConfigError, match="cpu_sigmoid.*'approx'.*fast"):
        lg.GPUOptions(cpu_sigmoid="approx")  # type: ignore[arg-type]
