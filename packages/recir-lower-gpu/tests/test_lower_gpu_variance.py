"""Short CPU variances (every layer norm's statistics) as two plain sums instead of Inductor's Welford
reduction (recir.lower_gpu._variance, ``GPUOptions.cpu_variance``): same values, no Welford code."""

from __future__ import annotations

import pytest
import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import assert_states_match_eager_sgd, kernel_files, kernel_source, train_sgd_compiled
from recir.lower_gpu._variance import MAX_ELEMENTS, two_pass_variance
from recir.transforms import ConfigError
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx


@pytest.mark.parametrize(
    ("shape", "dims", "correction", "keepdim"),
    [
        ((6, 64), [-1], 0, True),
        ((6, 64), [1], 1, False),
        ((3, 4, 5), [0, 2], 1, True),
        ((3, 4, 5), None, 0, False),
    ],
)
def test_two_pass_variance_equals_var_mean(shape, dims, correction, keepdim):
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.var_mean(x, dims, correction=correction, keepdim=keepdim)

    x = torch.randn(shape, dtype=torch.float64) * 3 + 1000  # a large mean: a naive E[x^2] - E[x]^2 loses it
    gm = make_fx(fn)(x)
    assert two_pass_variance(gm.graph) == 1
    gm.recompile()
    assert torch.ops.aten.var_mean.correction not in {n.target for n in gm.graph.nodes}
    outputs = gm(x)
    for got, want in zip(outputs, fn(x)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # every node the rewrite made carries its value's metadata, as Inductor's later passes read it
    (returned,) = [n for n in gm.graph.nodes if n.op == "output"]
    for node, got in zip(returned.args[0], outputs):
        assert node.meta["val"].shape == got.shape and node.meta["val"].dtype == got.dtype
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")


def test_long_low_precision_and_non_cpu_reductions_keep_welford():
    long = make_fx(lambda x: torch.var_mean(x, -1))(torch.randn(2, MAX_ELEMENTS + 1))
    assert two_pass_variance(long.graph) == 0
    meta = make_fx(lambda x: torch.var_mean(x, -1))(torch.randn(2, 8, device="meta"))
    assert two_pass_variance(meta.graph) == 0
    bf16 = make_fx(lambda x: torch.var_mean(x, -1))(torch.randn(2, 8, dtype=torch.bfloat16))
    assert two_pass_variance(bf16.graph) == 0  # Inductor's own lowering computes it in float32


class _NormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def test_compiled_layer_norm_step_has_no_welford_and_matches_welford_and_eager(tmp_path):
    """A step with a LayerNorm: the default compiles its statistics with no Welford code, the
    `welford` option with it (Inductor's own), and both train as eager torch.optim does (parameters
    and momenta after 5 steps)."""
    torch.manual_seed(0)
    model = _NormMLP()
    states = {}
    for variance in ("two_pass", "welford"):
        cache = tmp_path / variance
        options = lg.GPUOptions(cache_dir=str(cache), cpu_variance=variance)  # type: ignore[arg-type]
        states[variance] = train_sgd_compiled(model, options, n=16)
        assert ("welford" in kernel_source(kernel_files(cache)).lower()) == (variance == "welford"), variance
    assert_states_match_eager_sgd(model, _NormMLP(), states, n=16, rtol=1e-4, atol=1e-5)


def test_bad_cpu_variance_names_the_choices():
    with pytest.raises(ConfigError, match="cpu_variance.*'naive'.*two_pass"):
        lg.GPUOptions(cpu_variance="naive")  # type: ignore[arg-type]


def test_cpu_packages_compute_layer_norms_without_welford(tmp_path):
    """`package` (what `export` calls) on the CPU: a LayerNorm's statistics in two sums, the model's values."""
    import zipfile

    from recir.lower_gpu import package

    torch.manual_seed(0)
    model, x = _NormMLP().eval(), torch.randn(32, 8)
    path = package(torch.export.export(model, (x,)).run_decompositions(), tmp_path / "norm.pt2")
    with zipfile.ZipFile(path) as z:
        code = "".join(z.read(f).decode() for f in z.namelist() if f.endswith(".cpp"))
    assert "welford" not in code.lower() and "cpp_fused" in code
    got = torch._inductor.aoti_load_package(str(path))(x)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)
