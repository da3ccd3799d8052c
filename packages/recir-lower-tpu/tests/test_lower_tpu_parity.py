"""20-step parity of compiled captured steps against eager torch.optim, for every reference model.

Every parameter, buffer and optimizer-state tensor is compared after 20 steps (and the loss at each).
Tolerances (rtol=1e-4, atol=1e-5): XLA's CPU float32 kernels fuse and reorder reductions differently
from ATen's, and without x64 the optimizers' float64 scalars (bias corrections) run in float32; over 20
steps the drift stays around 1e-6, while a wrong lowering (a missed term, a wrong gradient, a stale
running statistic) is off by >1e-3 after one step. On a TPU the tolerances are 1e-3 / 1e-4: there float32
division, square roots and transcendentals are not ATen's to the last bit, and Adam divides each gradient by its
own running RMS, which magnifies that in near-zero gradients (measured on a v5e, 2026-12-06, float32 products at
``highest``: after 20 steps the Adam and AdamW cases' parameters within 5e-5 of eager's, losses within 1.4e-4
relative; SGD and Adagrad within the CPU tolerances).
"""

from __future__ import annotations

import jax
import pytest
import torch
from recir.capture import capture_train_step, testing
from recir.embedding import prepare_for_lowering
from recir.lower_tpu import LoweringError, TPUOptions, compile

pytestmark = pytest.mark.tpu

RTOL, ATOL = (1e-3, 1e-4) if jax.default_backend() == "tpu" else (1e-4, 1e-5)
STEPS = 20
OPTIMIZERS = ("sgd_momentum_wd", "adam", "adamw_amsgrad", "adagrad")
CASES = [(model, opt) for model in testing.REFERENCE_CASES for opt in OPTIMIZERS] + [
    ("embedding_bag", "rowwise_adagrad")
]
# The newest/oldest sessions' subset: a transformer, and a table with sparse row-wise updates.
SMOKE = {("transformer", "adamw_amsgrad"), ("embedding_bag", "rowwise_adagrad")}


@pytest.mark.parametrize(
    ("case_name", "opt_name"), [pytest.param(*c, marks=pytest.mark.smoke) if c in SMOKE else c for c in CASES]
)
def test_compiled_step_matches_eager_for_20_steps(case_name: str, opt_name: str) -> None:
    case = testing.REFERENCE_CASES[case_name]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    ref, ref_opt = testing.clone_pair(model, opt_name)
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    # Dense table updates: recir-embedding's row-wise ones are lazy (Adam) by design, not torch.optim's.
    compiled = compile(step, options=TPUOptions(sparse_updates=False))
    state = compiled.init_state(model, optimizer)

    for i in range(STEPS):
        batch = case.make_batch(i)
        old = state
        state, outputs = compiled(state, batch)
        assert all(x.is_deleted() for x in old), "state must be donated every step"
        ref_loss = testing.eager_step(ref, ref_opt, case.loss_fn, batch)
        torch.testing.assert_close(outputs[0], ref_loss, rtol=RTOL, atol=ATOL)

    got = compiled.state_dict(state)
    eager = testing.eager_state_dict(ref, ref_opt)
    missing = sorted(set(eager) - set(got))
    assert not missing, f"slots missing from the compiled state: {missing}"
    assert {k: v.dtype for k, v in got.items()} == {s.name: s.dtype for s in step.signature.state}
    bad = testing.state_mismatches(got, eager, rtol=RTOL, atol=ATOL)
    assert not bad, f"after {STEPS} steps these slots differ (max abs error): {bad}"


@pytest.mark.parametrize("opt_name", ["adam", "adagrad"])
def test_sparse_table_updates_match_the_prepared_reference(opt_name: str) -> None:
    # The default: recir-embedding rewrites table updates row-wise; the compiled step must compute
    # exactly what the rewritten StepGraph computes when interpreted by ATen.
    case = testing.REFERENCE_CASES["embedding_bag"]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    compiled = compile(step)
    assert "sparsify" in compiled.step.meta["recir.embedding"]
    prepared = prepare_for_lowering(step, target="tpu")
    ref = prepared.init_state(model, optimizer)
    state = compiled.init_state(model, optimizer)
    for i in range(10):
        state, outputs = compiled(state, case.make_batch(i))
        ref, ref_outputs = prepared(ref, case.make_batch(i))
        torch.testing.assert_close(outputs[0], ref_outputs[0], rtol=RTOL, atol=ATOL)
    bad = testing.state_mismatches(compiled.state_dict(state), prepared.state_dict(ref), rtol=RTOL, atol=ATOL)
    assert not bad, bad


def _dropout_step():
    case = testing.REFERENCE_CASES["transformer"]
    torch.manual_seed(0)
    model = testing.TransformerBlock(dropout=0.2)
    optimizer = testing.make_optimizer("adam", model.parameters())
    return case, model, optimizer, capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0))


def test_dropout_draws_the_same_stream_as_the_reference_interpreter() -> None:
    # Capture's counter-based RNG hashes (seed, offset, counter) in int64 ATen ops: the compiled step
    # must run them in 64 bits (x64 turns on by itself for rng slots) to reproduce the stream exactly.
    case, model, optimizer, step = _dropout_step()
    compiled = compile(step)
    assert compiled.x64
    ref = step.init_state(model, optimizer)  # draws the seed: start both sides from the same state
    state = compiled.load_state_dict(step.state_dict(ref))
    for i in range(3):
        state, outputs = compiled(state, case.make_batch(i))
        ref, ref_outputs = step(ref, case.make_batch(i))
        torch.testing.assert_close(outputs[0], ref_outputs[0], rtol=RTOL, atol=ATOL)
    bad = testing.state_mismatches(compiled.state_dict(state), step.state_dict(ref), rtol=RTOL, atol=ATOL)
    assert not bad, bad


def test_rng_without_x64_is_a_lowering_error_that_names_the_fix() -> None:
    case, model, optimizer, step = _dropout_step()
    compiled = compile(step, options=TPUOptions(x64=False))
    with pytest.raises(LoweringError, match=r"overflows 32-bit integers .* TPUOptions\(x64=True\)"):
        compiled(compiled.init_state(model, optimizer), case.make_batch(0))
