"""Inductor without AOTAutograd (``GPUOptions(aot_autograd=False)``, the CPU default): the same step as
through AOTAutograd, AOTAutograd never called, and the decomposed graph kept as plain data."""

from __future__ import annotations

import operator

import pytest
import recir.lower_gpu as lg
import torch
import torch.fx as fx
from recir.lower_gpu import _direct
from test_lower_gpu_regions import _batch, _step


def _train(options: lg.GPUOptions, steps: int = 3) -> dict[str, torch.Tensor]:
    model, opt, step = _step()
    compiled = lg.compile(step, device="cpu", options=options)
    state = compiled.init_state(model, opt)
    for i in range(1, steps + 1):
        state, _ = compiled(state, _batch(i))
    return compiled.state_dict(state)


@pytest.mark.parametrize("regions", ["whole", "repeated"])
def test_without_aot_autograd_the_step_trains_as_through_it(tmp_path, monkeypatch, regions):
    import torch._inductor.compile_fx as inductor

    calls = []
    compile_fx = inductor.compile_fx

    def spy(*args, **kwargs):
        calls.append(1)
        return compile_fx(*args, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", spy)
    traced = _direct.stats["traced"]
    direct = _train(lg.GPUOptions(regions=regions, aot_autograd=False, cache_dir=str(tmp_path / "direct")))
    assert not calls and _direct.stats["traced"] > traced  # every graph went around AOTAutograd
    through = _train(lg.GPUOptions(regions=regions, aot_autograd=True, cache_dir=str(tmp_path / "aot")))
    assert calls
    assert direct.keys() == through.keys()
    for name, value in through.items():  # parameters, Adam's moments and step, the table
        torch.testing.assert_close(direct[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_the_default_is_direct_on_the_cpu_only():
    assert not lg.GPUOptions().use_aot_autograd("cpu")
    assert lg.GPUOptions().use_aot_autograd("cuda")
    assert lg.GPUOptions(aot_autograd=True).use_aot_autograd("cpu")


def test_a_cached_compile_loads_the_decomposed_graph_and_a_torn_entry_is_a_miss(tmp_path):
    options = lg.GPUOptions(aot_autograd=False, cache_dir=str(tmp_path))
    first = _train(options, steps=1)
    entries = sorted((tmp_path / "recir-decomposed").glob("*.pkl"))
    assert len(entries) == 1
    loaded = _direct.stats["loaded"]
    assert _train(options, steps=1).keys() == first.keys()
    assert _direct.stats["loaded"] == loaded + 1
    entries[0].write_bytes(b"not a graph")  # a torn write or another version's entry
    traced = _direct.stats["traced"]
    again = _train(options, steps=1)
    assert _direct.stats["traced"] == traced + 1
    for name, value in first.items():
        torch.testing.assert_close(again[name], value, rtol=0, atol=0, msg=name)


def _graph() -> fx.GraphModule:
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    pair = g.call_function(torch.ops.aten.var_mean.correction, (x, [1]), {"correction": 0, "keepdim": True})
    var = g.call_function(operator.getitem, (pair, 0))
    z = g.call_function(torch.ops.aten.full.default, ([2, 3], 0.5), {"dtype": torch.float32, "device": "cpu"})
    out = g.call_function(
        torch.ops.aten.add.Tensor, (g.call_function(torch.ops.aten.mul.Tensor, (x, z)), var)
    )
    g.call_function(torch.ops.aten.copy_.default, (y, out))
    g.output((out, None))
    return fx.GraphModule(torch.nn.Module(), g, class_name="Piece")


def test_a_decomposed_graph_round_trips_as_plain_data():
    gm = _graph()
    back = _direct.decode_graph(_direct.encode_graph(gm))
    assert back.code == gm.code and type(back).__name__ == "Piece"
    x, y = torch.randn(2, 3), torch.zeros(2, 3)
    torch.testing.assert_close(back(x, y.clone())[0], gm(x, y.clone())[0], rtol=0, atol=0)


def test_a_graph_with_a_tensor_constant_is_not_kept():
    gm = _graph()
    node = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    node.args = (node.args[0], torch.ones(3))  # a tensor inside the graph: not plain data
    gm.recompile()
    assert _direct.encode_graph(gm) is None
    gm.register_buffer("c", torch.ones(3))
    with gm.graph.inserting_before(node):
        node.args = (node.args[0], gm.graph.get_attr("c"))
    gm.recompile()
    assert _direct.encode_graph(gm) is None and not _direct.can_compile_direct(gm)
