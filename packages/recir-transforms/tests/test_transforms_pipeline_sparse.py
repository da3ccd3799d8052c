"""recir-pipeline-sparse: the batch-only sparse work moves stages-1 batches ahead, the numbers do not change."""

from __future__ import annotations

import pytest
import torch
from _transforms_stepgraphs import mark_phase, trace_step
from recir.transforms import (
    OVERRIDE_KEY,
    PIPELINE_SPARSE_KEY,
    ConfigError,
    Pipeline,
    PipelinedStep,
    PipelineSparse,
    StepGraph,
    VerificationError,
    override_for_op,
    verify,
)

B, IDS, ROWS, FROZEN_ROWS, D = 4, 8, 32, 16, 3


def _sparse_step() -> tuple[StepGraph, list[torch.Tensor]]:
    """A trainable table looked up with hashed ids, a frozen table (never updated), a dense head, momentum SGD."""

    def fn(state, data):
        ids, offsets, dense, y = data
        table, head = (t.detach().requires_grad_(True) for t in (state[0], state[2]))
        frozen = state[1]
        hashed = torch.remainder(ids * 7 + 3, ROWS)  # id math: from the batch alone
        e = torch.ops.recir.embedding_bag(table, hashed, offsets, None, 0)
        f = torch.ops.recir.embedding_bag(frozen, torch.remainder(ids, FROZEN_ROWS), offsets, None, 1)
        pred = (torch.cat([e, f, dense], 1) @ head).squeeze(1)
        loss = ((pred - y) ** 2).mean()
        mark_phase("backward")
        g_table, g_head = torch.autograd.grad(loss, [table, head])
        mark_phase("optimizer")
        m_table, m_head = 0.9 * state[3] + g_table, 0.9 * state[4] + g_head
        return [(table - 0.1 * m_table).detach(), frozen, (head - 0.1 * m_head).detach(), m_table, m_head], [
            loss.detach()
        ]

    g = torch.Generator().manual_seed(0)
    state = {
        "param:table": ("param", torch.randn(ROWS, D, generator=g)),
        "param:frozen": ("param", torch.randn(FROZEN_ROWS, D, generator=g)),
        "param:head": ("param", torch.randn(2 * D + 1, 1, generator=g)),
        "optim:table:momentum_buffer": ("optim", torch.zeros(ROWS, D)),
        "optim:head:momentum_buffer": ("optim", torch.zeros(2 * D + 1, 1)),
    }
    return _traced(fn, state)


def _traced(fn, state: dict) -> tuple[StepGraph, list[torch.Tensor]]:  # noqa: ANN001
    """``fn`` traced over the batch ids/offsets/dense/y, its recir::embedding_bag nodes tagged as overrides."""
    data = {
        "ids": ("ids", torch.zeros(IDS, dtype=torch.long)),
        "offsets": ("offsets", torch.tensor([0, 2, 4, 6, 8])),
        "dense": ("dense", torch.zeros(B, 1)),
        "y": ("label", torch.zeros(B)),
    }
    step, s, _ = trace_step(fn, state, data, ["loss"])
    for node in step.graph.nodes:
        if node.target is torch.ops.recir.embedding_bag.default:
            node.meta[OVERRIDE_KEY] = override_for_op(node.target)
    return step, s


def _batches(n: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        cuts = torch.sort(torch.randint(0, IDS + 1, (B - 1,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.full((1,), IDS)])
        out.append(
            [
                torch.randint(0, 1000, (IDS,), generator=g),
                offsets,
                torch.randn(B, 1, generator=g),
                torch.randn(B, generator=g),
            ]
        )
    return out


def _unpipelined(step: StepGraph, state: list[torch.Tensor], batches) -> tuple[list[torch.Tensor], list]:
    losses = []
    for batch in batches:
        state, out = step(state, batch)
        losses.append(out[0])
    return state, losses


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("n", [1, 5])
def test_pipelined_run_equals_the_unpipelined_run_bit_for_bit(stages, n):
    step, state = _sparse_step()
    batches = _batches(n)
    want_state, want_losses = _unpipelined(step, list(state), batches)
    pipe = PipelinedStep.build(step, stages=stages)
    verify(pipe.steady)
    verify(pipe.prologue)
    got = pipe.load_state_dict(step.state_dict(state))  # an unpipelined state dict: carries start as zeros
    assert [s.name for s in pipe.carry_slots] == [s.name for s in pipe.steady.signature.state[len(state) :]]
    ran = list(pipe.run(got, batches))
    got, losses = ran[-1][0], [out[0] for _, out in ran]
    assert len(losses) == n and pipe.in_flight == 0
    for slot, a, b in zip(step.signature.state, got, want_state):  # parameters, momentum, the frozen table
        assert torch.equal(a, b), slot.name
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))


def test_the_id_math_and_the_frozen_lookup_move_the_trainable_lookup_stays():
    step, _ = _sparse_step()
    pipeline = Pipeline([PipelineSparse(stages=2)])
    steady = pipeline.run(step)
    stats = pipeline.records[0].stats
    info = steady.meta[PIPELINE_SPARSE_KEY]
    lookups = [n for n in steady.graph.nodes if n.target is torch.ops.recir.embedding_bag.default]
    # batch i's trainable lookup reads the carried hashed ids; the frozen lookup is batch i+1's, computed ahead
    (trained,) = [n for n in lookups if n.args[0].name != "param_frozen"]  # detach(param_table)
    (ahead,) = [n for n in lookups if n.args[0].name == "param_frozen"]
    assert trained.args[1].op == "placeholder" and trained.args[1].name.startswith("carry_0_")
    assert ahead.args[1].op != "placeholder"  # remainder(ids) of the new batch
    carried = [s.name for s in steady.signature.state if s.kind == "carry"]
    assert carried == [f"carry:0:{name}" for name in info.carried]
    assert "carry:0:embedding_bag_1" in carried  # the frozen table's rows of batch i
    assert {"carry:0:dense", "carry:0:y", "carry:0:offsets"} <= set(carried)  # raw batch i tensors still read
    assert "carry:0:ids" not in carried  # batch i's raw ids are read by moved nodes only
    assert stats["moved"] == len(info.moved) and stats["carried"] == len(carried)
    assert stats["carry_bytes"] == sum(
        torch.Size(s.shape).numel() * s.dtype.itemsize for s in steady.signature.state if s.kind == "carry"
    )
    assert "recir-pipeline-sparse" in pipeline.report()
    prologue = info.prologue
    assert prologue.signature.state == steady.signature.state and prologue.signature.outputs == ()
    assert not any(n.meta.get("recir.phase") in ("backward", "optimizer") for n in prologue.graph.nodes)


def test_nothing_to_move_is_reported_and_bad_options_say_what_to_pass():
    def fn(state, data):
        (x, y) = data
        w = state[0].detach().requires_grad_(True)
        loss = ((x @ w).squeeze(1) - y).pow(2).mean()
        mark_phase("backward")
        (g,) = torch.autograd.grad(loss, [w])
        mark_phase("optimizer")
        return [(w - 0.1 * g).detach()], [loss.detach()]

    dense, _, _ = trace_step(
        fn,
        {"param:w": ("param", torch.ones(3, 1))},
        {"x": ("dense", torch.ones(2, 3)), "y": ("label", torch.ones(2))},
        ["loss"],
    )
    result = PipelineSparse()(dense)
    assert not result.changed and "no batch-only" in result.stats["reason"]
    with pytest.raises(ConfigError, match="nothing to pipeline"):
        PipelinedStep.build(dense)
    for bad in (1, 0, 2.0, True):
        with pytest.raises(ConfigError, match="stages must be an int >= 2"):
            PipelineSparse(stages=bad)
    step, _ = _sparse_step()
    steady = PipelineSparse()(step).step
    with pytest.raises(ConfigError, match="already pipelined"):
        PipelineSparse()(steady)


def test_the_verifier_catches_a_carry_that_reads_updated_state():
    step, _ = _sparse_step()
    steady = PipelineSparse()(step).step
    verify(steady)
    phs = [n for n in steady.graph.nodes if n.op == "placeholder"]
    table = next(n for n in phs if n.name == "param_table")
    frozen_lookup = next(
        n
        for n in steady.graph.nodes
        if n.target is torch.ops.recir.embedding_bag.default and n.args[0].name == "param_frozen"
    )
    frozen_lookup.update_arg(0, table)  # a broken cut: batch i+1's rows read from the table batch i trains
    with pytest.raises(VerificationError, match="INV-10") as err:
        verify(steady)
    assert "param:table" in str(err.value) and "carry:0:embedding_bag_1" in str(err.value)


def test_a_value_both_sides_read_moves_and_is_carried():
    # the ids' view feeds the hashed lookup (moves ahead) and a dense feature (stays): the moved hash must
    # read the new batch's view, the dense feature batch i's carried one
    def fn(state, data):
        ids, offsets, dense, y = data
        table, head = (t.detach().requires_grad_(True) for t in state[:2])
        flat = ids.view(-1)
        e = torch.ops.recir.embedding_bag(table, torch.remainder(flat * 7 + 3, ROWS), offsets, None, 0)
        count = flat.to(torch.float32).mean().expand(B, 1) / 1000.0  # the raw ids as a dense feature
        pred = (torch.cat([e, dense, count], 1) @ head).squeeze(1)
        loss = ((pred - y) ** 2).mean()
        mark_phase("backward")
        g_table, g_head = torch.autograd.grad(loss, [table, head])
        mark_phase("optimizer")
        return [(table - 0.1 * g_table).detach(), (head - 0.1 * g_head).detach()], [loss.detach()]

    g = torch.Generator().manual_seed(0)
    state = {
        "param:table": ("param", torch.randn(ROWS, D, generator=g)),
        "param:head": ("param", torch.randn(D + 2, 1, generator=g)),
    }
    step, s = _traced(fn, state)
    batches = _batches(4)
    want_state, want_losses = _unpipelined(step, list(s), batches)
    pipe = PipelinedStep.build(step, stages=2)
    ran = list(pipe.run(pipe.load_state_dict(step.state_dict(s)), batches))
    got, losses = ran[-1][0], [out[0] for _, out in ran]
    assert all(torch.equal(a, b) for a, b in zip(got, want_state))
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    assert "view" in pipe.steady.meta[PIPELINE_SPARSE_KEY].moved


def test_build_reports_the_transform_like_any_pipeline(monkeypatch):
    step, _ = _sparse_step()
    pipe = PipelinedStep.build(step, stages=3)
    assert pipe.pipeline is not None and "recir-pipeline-sparse" in pipe.pipeline.report()
    assert pipe.stats["stages"] == 3 and pipe.stats["carry_bytes"] > 0
    monkeypatch.setenv("RECIR_DISABLE", "recir-pipeline-sparse")  # bisecting: the step stays unpipelined
    with pytest.raises(ConfigError, match="nothing to pipeline .*disabled"):
        PipelinedStep.build(step, stages=2)
