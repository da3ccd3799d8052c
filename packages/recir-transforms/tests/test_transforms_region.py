"""Region: finding coherent subgraphs (by nodes, pattern, phase, override) and replacing them by tracing."""

from __future__ import annotations

import re

import pytest
import torch
from _transforms_stepgraphs import embedding_sgd_step, mlp_sgd_step, run_steps
from recir.transforms import (
    OVERRIDE_KEY,
    PHASE_KEY,
    PROVENANCE_KEY,
    ConfigError,
    Pipeline,
    Region,
    RegionTransform,
    StepGraph,
    embedding_bag_reference,
    regions_by_id,
    regions_by_override,
    regions_by_pattern,
    regions_by_phase,
    register_transform,
    verify,
)


def _named(step, *names):
    by_name = {n.name: n for n in step.graph.nodes}
    return [by_name[n] for n in names]


def _root(node):
    """The value under make_fx's detach nodes (their number varies with the torch release; from torch 2.13
    they are alias nodes)."""
    while node.target in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        node = node.args[0]
    return node


def _assert_same_run(a: StepGraph, b: StepGraph, state, batch):
    sa, oa = run_steps(a, state, batch)
    sb, ob = run_steps(b, state, batch)
    for x, y in zip(sa, sb):  # parameters and optimizer state, not just the loss
        torch.testing.assert_close(x, y)
    torch.testing.assert_close(oa, ob)


def test_region_entries_exits_and_replace():
    step, state, batch = mlp_sgd_step()
    ref, _, _ = mlp_sgd_step()
    region = Region(step, _named(step, "mm", "add", "relu"), "fc1")
    assert [_root(n).name for n in region.inputs] == ["dense", "param_fc1_weight", "param_fc1_bias"]
    assert [n.name for n in region.outputs] == ["relu"]
    assert region.phases == ["forward"]
    new = region.replace(lambda x, w, b: torch.clamp_min(torch.addmm(b, x, w), 0.0), provenance="test")
    text = new.format()
    for entry in new.inputs:  # entries named by the value under make_fx's detach nodes
        text = re.sub(rf"%{entry.name}\b", f"%{_root(entry).name}", text)
    assert text == (
        "Region(fc1: 2 nodes, (%param_fc1_bias, %dense, %param_fc1_weight) -> (%clamp_min), forward)\n"
        "  %addmm = aten.addmm(%param_fc1_bias, %dense, %param_fc1_weight)  # forward\n"
        "  %clamp_min = aten.clamp_min(%addmm, 0.0)  # forward"
    )
    for node in new.nodes:
        assert node.meta[PHASE_KEY] == "forward" and node.meta[PROVENANCE_KEY] == ["test"]
        assert node.meta["recir.region"] == ["fc1"]
        assert isinstance(node.meta["val"], torch.Tensor)
    verify(step, level=2)
    _assert_same_run(step, ref, state, batch)


def test_region_entries_sharing_one_val_stay_distinct():
    step, state, batch = mlp_sgd_step()
    ref, _, _ = mlp_sgd_step()
    (m1,) = _named(step, "optim_fc1_weight_momentum_buffer")
    (sub,) = (n for n in step.graph.nodes if n.name == "sub_1")  # fc1.weight - lr * momentum'
    w1 = sub.args[0]  # fc1.weight, through make_fx's detach nodes
    assert _root(w1).name == "param_fc1_weight"
    m1.meta["val"] = w1.meta["val"]  # same shape: one FakeTensor object for two different values
    region = Region(step, [*_named(step, "mul_4", "add_1", "mul_7"), sub])
    assert region.inputs[:2] == [m1, _named(step, "mm_4")[0]] and w1 in region.inputs
    region.replace(lambda m, g, w: (0.9 * m + g, w - 0.1 * (0.9 * m + g)))
    verify(step, level=2)
    _assert_same_run(step, ref, state, batch)


def test_region_replace_reads_extra_inputs_from_outside():
    """``extra_inputs``: values the replacement reads that the old nodes did not (a swap to another
    parameter, as recir-embed-quantize-tables reads its quantised table), after the entries."""
    step, state, batch = mlp_sgd_step()
    (scale,) = (n for n in step.graph.nodes if n.name == "buffer_scale")
    region = Region(step, _named(step, "mm", "add", "relu"), "fc1")
    with pytest.raises(ConfigError, match="extra input %mm is a node of the region"):
        region.replace(lambda x, w, b, s: x, extra_inputs=_named(step, "mm"))
    new = region.replace(
        lambda x, w, b, s: torch.clamp_min(torch.addmm(b, x, w), 0.0) * s, extra_inputs=[scale]
    )
    assert scale in new.inputs
    verify(step, level=2)
    ref, _, _ = mlp_sgd_step()
    state = [t.clone() for t in state]
    state[step.signature.state_index("buffer:scale")] = torch.tensor(1.0)  # x * 1.0: the same step
    _assert_same_run(step, ref, state, batch)
    state[step.signature.state_index("buffer:scale")] = torch.tensor(2.0)
    with pytest.raises(AssertionError):
        _assert_same_run(step, ref, state, batch)


def test_region_rejects_non_convex_and_wrong_replacements():
    step, _, _ = mlp_sgd_step()
    with pytest.raises(ConfigError, match="not convex"):
        Region(step, _named(step, "mm", "relu"))  # add (outside) sits between them
    region = Region(step, _named(step, "mm", "add", "relu"))
    with pytest.raises(
        ConfigError, match=r"exit %relu is float32\[3, 8\], the replacement gives float32\[8\]"
    ):
        region.replace(lambda x, w, b: b)
    with pytest.raises(ConfigError, match="returns 2 values"):
        region.replace(lambda x, w, b: (x, x))
    mixed = Region(step, _named(step, "mean", "ones_like"))
    with pytest.raises(ConfigError, match="spans phases"):
        mixed.replace(lambda x: (x, x))


def test_regions_by_pattern_and_phase_match_counts():
    step, _, _ = mlp_sgd_step()
    found = regions_by_pattern(step, lambda x, w, b: torch.relu(x @ w + b), [torch.ones(2, 2)] * 3)
    assert [[n.name for n in r.nodes] for r in found] == [["mm", "add", "relu"]]
    # every mm of the step (1 forward mm and 1 forward mm_1, 3 backward mms) matches a bare mm pattern
    mms = regions_by_pattern(step, torch.mm, [torch.ones(2, 2)] * 2)
    assert len(mms) == 5
    assert len(regions_by_pattern(step, torch.mm, [torch.ones(2, 2)] * 2, phase="backward")) == 3
    assert regions_by_pattern(step, lambda x: torch.sigmoid(x), [torch.ones(2)]) == []
    (fwd,) = regions_by_phase(step, "forward")
    counts = step.phase_counts()
    assert len(fwd) == counts["forward"] and [len(r) for r in regions_by_phase(step, "optimizer")] == [
        counts["optimizer"]
    ]
    assert regions_by_id(step, "nothing") == []


def test_regions_by_override_swap_to_the_reference():
    step, state, batch = embedding_sgd_step()
    ref, _, _ = embedding_sgd_step()
    (region,) = regions_by_override(step, "recir-embedding-bag")
    assert [n.target for n in region.nodes] == [torch.ops.recir.embedding_bag.default]
    assert regions_by_override(step, "recir-other") == []
    new = region.replace(lambda w, ids, offs: embedding_bag_reference(w, ids, offs, None, 0))
    assert all(OVERRIDE_KEY not in n.meta for n in new.nodes) and len(new) > 3
    verify(step, level=2)
    _assert_same_run(step, ref, state, batch)


@register_transform
class InlineEmbeddingBag(RegionTransform):
    """Test RegionTransform: recir::embedding_bag -> its pure-ATen reference."""

    name = "recir-test-inline-embedding-bag"

    def match(self, step):
        return regions_by_override(step, "recir-embedding-bag")

    def rewrite(self, step, region):
        (node,) = region.nodes
        mode = node.args[4]
        region.replace(lambda w, i, o: embedding_bag_reference(w, i, o, None, mode), provenance=self.name)


def test_region_transform_in_a_pipeline():
    step, state, batch = embedding_sgd_step()
    ref, _, _ = embedding_sgd_step()
    pipe = Pipeline([InlineEmbeddingBag()])
    out = pipe.run(step)
    assert pipe.records[0].stats == {"matched": 1, "rewritten": 1}
    assert not regions_by_override(out, "recir-embedding-bag")
    _assert_same_run(out, ref, state, batch)
    pipe.run(out)  # negative case: nothing left to match
    assert pipe.records[0].status == "unchanged" and pipe.records[0].stats == {"matched": 0, "rewritten": 0}
