"""float32 -> bfloat16 rounding in the CPU kernels (recir.lower_gpu._cpp_codegen, ``GPUOptions.cpu_bf16``):
``native`` writes avx512_bf16's instruction where Inductor builds with it, ``aten`` keeps ATen's integer
rounding; both give eager's bits for every normal value, train as eager torch.optim does, and the choice
is part of Inductor's cache keys."""

from __future__ import annotations

import zipfile

import pytest
import recir.lower_gpu as lg
import torch
import torch.nn.functional as F
from _lower_gpu_steps import assert_states_match_eager_sgd, kernel_files, kernel_source, train_sgd_compiled
from recir.lower_gpu._cpp_codegen import _builds_avx512_bf16
from recir.transforms import ConfigError
from torch import nn

_NATIVE = "_mm512_cvtne2ps_pbh"
_ATEN = "at::vec::convert<at::BFloat16,1,float,2>"  # Inductor's own 32-lane float32 -> bf16 conversion


def _native_expected(mode: str) -> bool:
    return mode == "native" and _builds_avx512_bf16()


class _Bf16MLP(nn.Module):
    """The second product on bf16 copies of its operands, as recir-mixed-precision writes it (an extern
    product reads them, so the kernels store them rounded; Inductor drops a round trip it can fuse)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x)).to(torch.bfloat16)
        return (h @ self.fc2.weight.to(torch.bfloat16).t()).float() + self.fc2.bias


class _Round(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.bfloat16)


def _inputs() -> torch.Tensor:
    """Every kind of float32 the rounding treats differently: magnitudes over float's whole range, exact
    ties (low 16 bits 0x8000, even and odd kept bit), what rounds up to infinity, infinities, NaN, zeros
    and subnormals."""
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(8192, generator=g) * torch.pow(
        10.0, torch.empty(8192).uniform_(-37, 37, generator=g)
    )
    ties = (torch.randint(0, 1 << 15, (1024,), generator=g, dtype=torch.int32) << 16) | 0x8000
    ties = torch.cat([ties, ties | (1 << 16), ties | (1 << 31)]).view(torch.float32)
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            3.4028235e38,
            -3.4028235e38,
            1e-40,
            -1e-39,
            1e-38,
        ]
    )
    # the specials first and last: in the kernel's full vectors and in its tail
    return torch.cat([specials, spread, ties, specials])


@pytest.mark.parametrize("mode", ["native", "aten"])
def test_cpu_package_rounds_as_eager_does(tmp_path, mode):
    """`package` on the CPU: the kernel uses the instruction exactly when chosen and available, and every
    non-subnormal input rounds to eager's bits (ties to even, overflow to infinity, NaN stays NaN);
    subnormals become zero under the instruction and eager's subnormals under ATen's rounding."""
    x = _inputs()
    program = torch.export.export(_Round(), (x,)).run_decompositions()
    path = lg.package(program, tmp_path / "round.pt2", cpu_bf16=mode)  # type: ignore[arg-type]
    with zipfile.ZipFile(path) as z:
        code = "".join(z.read(f).decode() for f in z.namelist() if f.endswith(".cpp"))
    assert (_NATIVE in code) == _native_expected(mode)
    got = torch._inductor.aoti_load_package(str(path))(x)
    want = x.to(torch.bfloat16)
    nan = x.isnan()
    assert got[nan].isnan().all()
    subnormal = (x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)
    assert subnormal.sum() >= 4  # 1e-40 and -1e-39 twice, and some of the ties
    normal = ~nan & ~subnormal
    assert torch.equal(got[normal].view(torch.int16), want[normal].view(torch.int16))
    if _native_expected(mode):
        assert (got[subnormal] == 0).all()
    else:
        assert torch.equal(got[subnormal].view(torch.int16), want[subnormal].view(torch.int16))


def test_compiled_steps_round_as_chosen_and_train_as_eager(tmp_path):
    """A training step with bf16 round trips, compiled `native` then `aten` into one cache folder: each
    compile's kernels round as chosen (the second does not reuse the first's from the FX-graph or
    AOTAutograd cache), and both give torch.optim's parameters and momenta after 5 steps."""
    torch.manual_seed(0)
    model = _Bf16MLP()
    states, seen = {}, set()
    for mode in ("native", "aten"):
        options = lg.GPUOptions(cache_dir=str(tmp_path), cpu_bf16=mode)  # type: ignore[arg-type]
        states[mode] = train_sgd_compiled(model, options, n=32)
        new = kernel_files(tmp_path) - seen
        seen |= new
        code = kernel_source(new)
        assert (_NATIVE in code, _ATEN in code) == (_native_expected(mode), not _native_expected(mode)), mode
    assert_states_match_eager_sgd(model, _Bf16MLP(), states, n=32, rtol=1e-5, atol=1e-6)


def test_bad_cpu_bf16_names_the_choices():
    with pytest.raises(ConfigError, match="cpu_bf16.*'fast'.*native"):
        lg.GPUOptions(cpu_bf16="fast")  # type: ignore[arg-type]
