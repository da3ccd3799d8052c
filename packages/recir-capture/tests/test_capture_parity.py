"""20-step parity: the captured StepGraph against eager ``loss.backward(); opt.step(); opt.zero_grad()``.

Every parameter, buffer and optimizer-state tensor is compared after 20 steps, and gradients at step 1.
Tolerances: both sides run the same float32 maths; differences come only from rounding (a few ulps per
op: decomposed vs fused kernels, FMA, float32 vs float64 scalars such as lr, the math SDPA path vs
the CPU flash kernel). Over 20 stable steps they stay below 1e-6 absolute / 1e-5 relative; rtol=1e-4,
atol=1e-5 leaves room across BLAS builds while a wrong formula (off by a factor, a missed bias
correction, a skipped weight decay) is off by >1e-3 after one step. Adam divides by sqrt(v)+eps, which
turns a near-zero gradient's rounding noise into a full lr-sized step, so the gradients that feed the
optimizer are also compared at step 1, tightly.
"""

from __future__ import annotations

import pytest
import torch
from recir.capture import capture_train_step, testing

RTOL, ATOL = 1e-4, 1e-5
STEPS = 20

CASES = [("mlp", name) for name in testing.OPTIMIZERS] + [
    ("transformer", "sgd_momentum_wd"),
    ("transformer", "adamw_amsgrad"),
    ("embedding_bag", "rowwise_adagrad"),
    ("embedding_bag", "adagrad"),
    ("embedding_bag", "adam"),
    ("batchnorm", "sgd_nesterov"),
    ("batchnorm", "adam_wd_maximize"),
]
# The newest/oldest sessions' subset: one case per model kind.
SMOKE = {
    ("mlp", "adam"),
    ("transformer", "adamw_amsgrad"),
    ("embedding_bag", "rowwise_adagrad"),
    ("batchnorm", "adam_wd_maximize"),
}


def _run_parity(case_name: str, opt_name: str, steps: int = STEPS) -> None:
    case = testing.REFERENCE_CASES[case_name]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    ref, ref_opt = testing.clone_pair(model, opt_name)
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    state = step.init_state(model, optimizer)

    grads = testing.captured_gradients(step, state, case.make_batch(0))
    ref_grads = testing.eager_gradients(ref, case.loss_fn, case.make_batch(0))
    assert set(grads) == set(ref_grads) == {f"param:{n}" for n, _ in model.named_parameters()}
    bad = testing.state_mismatches(grads, ref_grads, rtol=1e-5, atol=1e-6)
    assert not bad, f"step-1 gradients differ: {bad}"

    for i in range(steps):
        batch = case.make_batch(i)
        state, outputs = step(state, batch)
        ref_loss = testing.eager_step(ref, ref_opt, case.loss_fn, batch)
        torch.testing.assert_close(outputs[0], ref_loss, rtol=RTOL, atol=ATOL)

    captured = step.state_dict(state)
    eager = testing.eager_state_dict(ref, ref_opt)
    # every eager tensor has a captured counterpart (nothing silently missing from the comparison)
    missing = sorted(set(eager) - set(captured))
    assert not missing, f"slots missing from the captured state: {missing}"
    bad = testing.state_mismatches(captured, eager, rtol=RTOL, atol=ATOL)
    assert not bad, f"after {steps} steps these slots differ (max abs error): {bad}"
    # the live model and optimizer were never touched by capture or by running the step
    for (n, p), (_, q) in zip(model.named_parameters(), case.build(seed=0).named_parameters()):
        assert torch.equal(p, q), f"capture or the step modified the live parameter {n}"


@pytest.mark.parametrize(
    ("case_name", "opt_name"), [pytest.param(*c, marks=pytest.mark.smoke) if c in SMOKE else c for c in CASES]
)
def test_capture_parity_20_steps(case_name: str, opt_name: str) -> None:
    _run_parity(case_name, opt_name)
