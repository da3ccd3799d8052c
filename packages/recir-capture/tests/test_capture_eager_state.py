"""state_from / load_into: an eager model and its optimizers as slot-named state and back, so training
continues bit for bit after a round trip, and a captured step's state continues eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
from recir.capture import (
    capture_train_step,
    load_into,
    shared_step_layout,
    state_from,
    testing,
    with_shared_step,
)
from recir.transforms import STEP_SLOT

CASE = testing.REFERENCE_CASES["embedding_bag"]


def _run(model, opt, steps, start):
    for i in range(start, start + steps):
        testing.eager_step(model, opt, CASE.loss_fn, CASE.make_batch(i))


@pytest.mark.parametrize("opt_name", ["adam", "rowwise_adagrad", "sgd_momentum_wd"])
def test_round_trip_continues_training_bit_for_bit(opt_name):
    a = CASE.build(seed=0)
    opt_a = testing.make_optimizer(opt_name, a.parameters())
    _run(a, opt_a, 3, 0)
    saved = {k: v.clone() for k, v in state_from(a, [opt_a]).items()}
    assert any(k.startswith("optim:") for k in saved) and all(not k.startswith("optim:step") for k in saved)

    b = CASE.build(seed=1)  # other weights, empty optimizer state
    opt_b = testing.make_optimizer(opt_name, b.parameters())
    load_into(b, [opt_b], saved)
    _run(a, opt_a, 3, 3)
    _run(b, opt_b, 3, 3)
    got, want = state_from(b, [opt_b]), state_from(a, [opt_a])
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_captured_steps_state_continues_eagerly():
    """The captured step's one `optim:step` becomes every Adam parameter's step count."""
    model = CASE.build(seed=0)
    opt = testing.make_optimizer("adam", model.parameters())
    step = capture_train_step(model, opt, CASE.loss_fn, CASE.make_batch(0), overrides=CASE.overrides())
    state = step.init_state(model, opt)
    for i in range(3):
        state, _ = step(state, CASE.make_batch(i))
    captured = step.state_dict(state)
    assert STEP_SLOT in captured

    eager = copy.deepcopy(model)
    eager_opt = testing.make_optimizer("adam", eager.parameters())
    load_into(eager, [eager_opt], captured)
    _run(eager, eager_opt, 2, 3)
    for i in range(3, 5):
        state, _ = step(state, CASE.make_batch(i))
    got = shared_step_layout(state_from(eager, [eager_opt]), lambda x, y: bool(torch.equal(x, y)))
    want = step.state_dict(state)
    assert STEP_SLOT in got
    for name, value in got.items():
        torch.testing.assert_close(value.float(), want[name].float(), rtol=1e-6, atol=1e-6, msg=name)


def test_with_shared_step_takes_an_eager_per_parameter_step():
    eager = {"param:w": torch.ones(2), "optim:w:step": torch.tensor(4.0)}
    assert with_shared_step(eager)[STEP_SLOT].item() == 4.0
    assert STEP_SLOT not in with_shared_step({"param:w": torch.ones(2)})
