"""Pipeline: ordering, verification per RECIR_VERIFY, provenance, dumps, disabling, reports, textual form."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _transforms_stepgraphs import mlp_sgd_step, run_steps
from recir.transforms import (
    PHASE_KEY,
    PROVENANCE_KEY,
    ConfigError,
    Pipeline,
    StepGraph,
    Transform,
    TransformResult,
    VerificationError,
    format_transform,
    parse_pipeline,
    register_transform,
)


@register_transform
class ReluToClamp(Transform):
    """Test transform: relu(x) -> clamp_min(x, floor) (same numerics for floor=0)."""

    name = "recir-test-relu-to-clamp"
    summary = "relu -> clamp_min"

    @dataclasses.dataclass(frozen=True)
    class Options:
        floor: float = 0.0
        tag: str = "x"

    def run(self, step: StepGraph) -> TransformResult:
        n = 0
        for node in list(step.graph.nodes):
            if node.target is torch.ops.aten.relu.default:
                with step.graph.inserting_after(node):
                    new = step.graph.call_function(
                        torch.ops.aten.clamp_min.default, (node.args[0], self.options.floor)
                    )
                new.meta.update(node.meta)
                node.replace_all_uses_with(new)
                step.graph.erase_node(node)
                n += 1
        return TransformResult(step, n > 0, {"replaced": n})


@register_transform
class BreakPhase(Transform):
    """Deliberately broken: forgets the phase on a node it rewrites (the verifier must catch it)."""

    name = "recir-test-break-phase"

    def run(self, step: StepGraph) -> TransformResult:
        node = next(n for n in step.graph.nodes if n.target is torch.ops.aten.mm.default)
        del node.meta[PHASE_KEY]
        return TransformResult(step, True, {})


def test_pipeline_runs_in_order_and_stamps_provenance():
    step, state, batch = mlp_sgd_step()
    ref_state, ref_out = run_steps(step, state, batch)
    pipe = Pipeline([ReluToClamp()])
    out = pipe.run(step)
    # the new node is created; its users (a detach, or an alias from torch 2.13, mm_1, t) changed their
    # arguments: all are stamped
    stamped = {n.name: n.meta[PROVENANCE_KEY] for n in out.graph.nodes if n.meta.get(PROVENANCE_KEY)}
    identity = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
    (detach,) = (
        n for n in out.graph.nodes if n.name == "clamp_min_default" for n in n.users if n.target in identity
    )
    assert stamped == dict.fromkeys(
        ["clamp_min_default", detach.name, "mm_1", "t"], ["recir-test-relu-to-clamp"]
    )
    rec = pipe.records[0]
    assert (rec.status, rec.added, rec.removed, rec.modified) == ("changed", 1, 1, 3)
    # (the node count depends on how many detach nodes make_fx emits: fewer on newer torch releases)
    assert rec.stats == {"replaced": 1} and rec.nodes_before == rec.nodes_after == len(step.graph.nodes)
    new_state, new_out = run_steps(out, state, batch)
    for a, b in zip(new_state, ref_state):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(new_out, ref_out)


class EditInPlace(Transform):
    """Test transform: applies ``edit(step)`` to the graph in place."""

    name = "recir-test-edit-in-place"

    def __init__(self, edit) -> None:
        super().__init__()
        self.edit = edit

    def run(self, step: StepGraph) -> TransformResult:
        self.edit(step)
        return TransformResult(step, True, {})


def test_pipeline_sees_every_kind_of_in_place_edit():
    """Signatures are remembered per node between transforms; each edit below must still count as a
    change and be stamped: new arguments, new metadata, a mutable metadata value changed in place, a
    renamed input, a new value, a metadata value moved to another key."""
    step, _, _ = mlp_sgd_step()
    mm = next(n for n in step.graph.nodes if n.target is torch.ops.aten.mm.default)
    (a, b) = mm.args[:2]

    def swap_args(step):
        mm.args = (b, a)

    def tag(step):
        mm.meta["recir.test"] = ["first"]
        mm.meta["recir.label"] = "a label"

    def tag_again(step):
        mm.meta["recir.test"].append("second")

    def rename_input(step):
        a.name = a.name + "_renamed"

    def new_val(step):
        mm.meta["val"] = torch.empty(3, 3, dtype=torch.float64)
        mm.meta["recir.test"] = "no longer a list"

    def retag(step):  # the same value under another key, in the same place
        mm.meta["recir.other"] = mm.meta.pop("recir.label")

    edits = [swap_args, tag, tag_again, rename_input, new_val, retag]
    pipe = Pipeline([EditInPlace(e) for e in edits], verify_level=0)
    out = pipe.run(step)
    assert [r.modified for r in pipe.records] == [1, 1, 1, len(a.users), 1, 1]
    assert out.graph is step.graph and mm.meta[PROVENANCE_KEY] == ["recir-test-edit-in-place"]
    # nothing changed: nothing counted
    again = Pipeline([EditInPlace(lambda step: None)], verify_level=0)
    again.run(out)
    assert (again.records[0].added, again.records[0].removed, again.records[0].modified) == (0, 0, 0)


def test_broken_transform_is_caught_at_level_2_and_named(monkeypatch):
    monkeypatch.setenv("RECIR_VERIFY", "2")
    step, _, _ = mlp_sgd_step()
    with pytest.raises(VerificationError) as info:
        Pipeline([ReluToClamp(), BreakPhase()]).run(step)
    assert info.value.invariant == "INV-5" and info.value.transform == "recir-test-break-phase"
    assert "transform: recir-test-break-phase" in str(info.value)


def test_level_1_verifies_at_the_end_and_level_0_not_at_all(monkeypatch):
    step, _, _ = mlp_sgd_step()
    with pytest.raises(VerificationError) as info:
        Pipeline([BreakPhase()], verify_level=1).run(step)
    assert "RECIR_VERIFY=2" in str(info.value)
    step, _, _ = mlp_sgd_step()
    monkeypatch.setenv("RECIR_VERIFY", "0")
    Pipeline([BreakPhase()]).run(step)


def test_disable_by_name_and_env(monkeypatch):
    step, _, _ = mlp_sgd_step()
    pipe = Pipeline([ReluToClamp(), BreakPhase()], disable={"recir-test-break-phase"})
    pipe.run(step)
    assert [r.status for r in pipe.records] == ["changed", "disabled"]
    monkeypatch.setenv("RECIR_DISABLE", "recir-test-break-phase, recir-test-relu-to-clamp")
    step, _, _ = mlp_sgd_step()
    pipe = Pipeline([ReluToClamp(), BreakPhase()])
    pipe.run(step)
    assert [r.status for r in pipe.records] == ["disabled", "disabled"]
    assert "disabled" in pipe.report()
    with pytest.raises(ConfigError, match="recir-no-such-thing"):
        Pipeline([ReluToClamp()], disable={"recir-no-such-thing"}).run(step)
    monkeypatch.setenv("RECIR_DISABLE", "recir-no-such-thing")
    with pytest.warns(UserWarning, match="recir-no-such-thing"):
        Pipeline([ReluToClamp()]).run(step)


def test_dumps_before_and_after(tmp_path, monkeypatch):
    monkeypatch.setenv("RECIR_DUMP_DIR", str(tmp_path))
    step, _, _ = mlp_sgd_step()
    Pipeline("recir-test-relu-to-clamp").run(step)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["001-recir-test-relu-to-clamp.after.txt", "001-recir-test-relu-to-clamp.before.txt"]
    before = (tmp_path / names[1]).read_text()
    after = (tmp_path / names[0]).read_text()
    assert "%relu = aten.relu(%add)  # forward" in before
    assert "%clamp_min_default = aten.clamp_min(%add, 0.0)  # forward" in after and "aten.relu" not in after
    # a second pipeline into the same directory continues the numbering
    Pipeline("recir-cleanup-dce,recir-cleanup-cse").run(step)
    assert sorted(p.name for p in tmp_path.iterdir())[2:] == [
        "002-recir-cleanup-dce.after.txt",
        "002-recir-cleanup-dce.before.txt",
        "003-recir-cleanup-cse.after.txt",
        "003-recir-cleanup-cse.before.txt",
    ]


def test_report_is_a_readable_table():
    step, _, _ = mlp_sgd_step()
    pipe = Pipeline([ReluToClamp()], name="test")
    pipe.run(step)
    lines = pipe.report().splitlines()
    assert lines[0] == "test: recir-test-relu-to-clamp (RECIR_VERIFY=2)"
    assert lines[1].split() == ["#", "transform", "status", "ms", "nodes", "+add", "-del", "~mod", "stats"]
    assert lines[2].split()[:3] == ["1", "recir-test-relu-to-clamp", "changed"]
    assert "replaced=1" in lines[2] and lines[-1].startswith("total ")


def test_report_shortens_long_stats_and_records_keep_them():
    class ManyReasons(Transform):
        name = "recir-test-many-reasons"

        def run(self, step: StepGraph) -> TransformResult:
            reasons = {f"param:w{i}": "its gradient is not a row gather " * 3 for i in range(40)}
            return TransformResult(step, False, {"skipped": reasons, "kept": 2})

    step, _, _ = mlp_sgd_step()
    pipe = Pipeline([ManyReasons()], name="test")
    pipe.run(step)
    row = pipe.report().splitlines()[2]
    assert "skipped=<40: param:w0, param:w1, param:w2, ...>, kept=2" in row and len(row) < 200, row
    assert len(pipe.records[0].stats["skipped"]) == 40


def test_textual_pipelines_round_trip_with_options():
    pipe = parse_pipeline("recir-test-relu-to-clamp{floor=0.5, tag='a b'}, recir-test-break-phase")
    first = pipe.transforms[0]
    assert first.options.floor == 0.5 and first.options.tag == "a b"
    assert str(pipe) == "recir-test-relu-to-clamp{floor=0.5,tag='a b'},recir-test-break-phase"
    assert str(parse_pipeline(str(pipe))) == str(pipe)
    assert format_transform(ReluToClamp()) == "recir-test-relu-to-clamp"
    with pytest.raises(ConfigError, match="unknown option 'flor'"):
        parse_pipeline("recir-test-relu-to-clamp{flor=1}")
    with pytest.raises(ConfigError, match="unknown transform 'recir-nope'"):
        parse_pipeline("recir-nope")


@pytest.fixture
def recompiles(monkeypatch) -> list[int]:
    """Each GraphModule code generation (its graph's node count), also a lazy module's first real one."""
    calls: list[int] = []
    recompile = torch.fx.GraphModule.recompile

    def counted(self):
        calls.append(len(self.graph.nodes))
        return recompile(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    return calls


def test_the_code_follows_the_graph_and_is_regenerated_only_on_change(recompiles):
    """A transform that edits the graph in place (no recompile of its own) leaves code that runs the new
    graph; a transform that changes nothing costs no code generation (a 3k-node step: ~0.1 s each)."""
    step, _, _ = mlp_sgd_step()
    calls = recompiles
    calls.clear()  # only what follows counts
    pipeline = Pipeline([ReluToClamp(tag="first"), ReluToClamp(tag="again")], verify_level=0)
    out = pipeline.run(step)
    assert [r.status for r in pipeline.records] == ["changed", "unchanged"]
    assert len(calls) == 1, calls  # the first rewrote relu; the second found none
    assert "clamp_min" in out.graph_module.code and "relu" not in out.graph_module.code


def test_a_copied_step_writes_its_code_once_when_first_run(recompiles):
    """step.copy() makes a lazy GraphModule: copying, rewriting and recompile() write no Python code (a
    full-size DLRMv3 step: ~0.3 s each, about 1 s of a cached compile); the first run writes it once, for
    the graph as it is then."""
    step, state, batch = mlp_sgd_step()
    want_state, want_out = run_steps(step, state, batch, n=1)
    calls = recompiles
    calls.clear()  # only what follows counts
    copy = step.copy()
    out = Pipeline([ReluToClamp()], verify_level=0).run(copy)
    out.graph_module.recompile()  # what a transform does after an edit
    assert calls == []
    for _ in range(2):
        got_state, got_out = run_steps(out, state, batch, n=1)
        assert all(torch.equal(a, b) for a, b in zip(got_state, want_state))
        assert all(torch.equal(a, b) for a, b in zip(got_out, want_out))
    assert len(calls) == 1
    assert "clamp_min" in out.graph_module.code and "relu" not in out.graph_module.code
    assert "relu" in step.graph_module.code  # the original keeps its own graph and code
