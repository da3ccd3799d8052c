"""The CPU sigmoid's exponential (recir.lower_gpu._cpp_codegen, ``GPUOptions.cpu_sigmoid``): ``fast`` writes
an inline exponential into Inductor's vectorised sigmoid (``vscalefps`` on AVX-512, ATen's ``exp_u20``
elsewhere), ``sleef`` keeps Inductor's SLEEF call; both train as eager torch.optim does, both keep NaN and
infinities as eager does, and the choice is part of Inductor's cache keys."""

from __future__ import annotations

import zipfile

import pytest
import recir.lower_gpu as lg
import recir.lower_gpu._cpp_codegen as cpp_codegen
import torch
import torch.nn.functional as F
from _lower_gpu_steps import assert_states_match_eager_sgd, kernel_files, kernel_source, train_sgd_compiled
from recir.transforms import ConfigError
from torch import nn

_SLEEF = ".neg().exp())"  # Inductor's own vectorised sigmoid: 1 / (1 + exp(-x))


def _fast(code: str) -> bool:
    """Whether ``code`` holds ``fast``'s sigmoid: AVX-512's ``vscalefps`` exponential or ATen's ``exp_u20``."""
    return "_mm512_scalef_ps" in code or "exp_u20()" in code


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
        assert (_fast(code), _SLEEF in code) == (mode == "fast", mode == "sleef"), mode
    assert_states_match_eager_sgd(model, _SiluMLP(), states, n=32, rtol=1e-5, atol=1e-6)


def test_the_choice_is_in_inductors_cache_key(tmp_path):
    """One cache folder, the same step compiled `fast` then `sleef`: the second compile generates its own
    kernels (SLEEF's call), it does not reuse the first's from the FX-graph or AOTAutograd cache."""
    torch.manual_seed(0)
    model = _SiluMLP()
    train_sgd_compiled(model, lg.GPUOptions(cache_dir=str(tmp_path), cpu_sigmoid="fast"), n=32)
    first = kernel_files(tmp_path)
    assert _fast(kernel_source(first)) and _SLEEF not in kernel_source(first)
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
    assert (_fast(code), _SLEEF in code) == (mode == "fast", mode == "sleef")
    got = torch._inductor.aoti_load_package(str(path))(x)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)


class _Sigmoids(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sigmoid(x), F.silu(x)


@pytest.mark.parametrize("isa", ["native", "without_avx512"])
def test_fast_sigmoid_keeps_nan_and_infinities_and_float_accuracy(tmp_path, monkeypatch, isa):
    """``fast`` on each of its two codes (the AVX-512 one where this CPU has it, ``exp_u20`` otherwise, forced
    here): NaN stays NaN (``exp_u20`` alone clamps it into a number: sigmoid(NaN) came out 0), +-inf give 1
    and 0, and over 256K inputs in [-100, 100] the sigmoid and SiLU stay within 6e-7 relative of float64's
    wherever that is a normal float (measured 2.6e-7 with ``vscalefps``, 4.1e-7 with ``exp_u20``)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # kernels of this choice only
    if isa == "without_avx512":
        monkeypatch.setattr(cpp_codegen, "_builds_avx512", lambda: False)
    x = torch.empty(4096, 64).uniform_(-100.0, 100.0, generator=torch.Generator().manual_seed(0))
    specials = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 88.0, -88.0, 17.0, -17.0])
    x[0, : specials.numel()] = specials
    program = torch.export.export(_Sigmoids(), (x,)).run_decompositions()
    path = lg.package(program, tmp_path / "sigmoid.pt2", cpu_sigmoid="fast")
    with zipfile.ZipFile(path) as z:
        code = "".join(z.read(f).decode() for f in z.namelist() if f.endswith(".cpp"))
    assert ("_mm512_scalef_ps" in code) == (isa == "native" and cpp_codegen._builds_avx512())
    sigmoid, silu = torch._inductor.aoti_load_package(str(path))(x)
    got = sigmoid[0, : specials.numel()]
    torch.testing.assert_close(got, torch.sigmoid(specials), equal_nan=True, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(
        silu[0, : specials.numel()], F.silu(specials), equal_nan=True, rtol=1e-6, atol=0.0
    )
    ref = torch.sigmoid(x.double())
    normal = (ref.abs() > torch.finfo(torch.float32).tiny) & x.isfinite()
    assert float(((sigmoid.double() - ref).abs() / ref)[normal].max()) < 6e-7
    silu_ref = x.double() * ref
    normal &= silu_ref.abs() > torch.finfo(torch.float32).tiny
    assert float(((silu.double() - silu_ref).abs() / silu_ref.abs())[normal].max()) < 6e-7


def test_bad_cpu_sigmoid_names_the_choices():
    with pytest.raises(ConfigError, match="cpu_sigmoid.*'approx'.*fast"):
        lg.GPUOptions(cpu_sigmoid="approx")  # type: ignore[arg-type]
