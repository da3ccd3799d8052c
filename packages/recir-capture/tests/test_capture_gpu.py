"""Capture of a CUDA model: fake tensors and state slots live on the model's device."""

from __future__ import annotations

import pytest
from recir.capture import capture_train_step, testing


@pytest.mark.gpu
@pytest.mark.parametrize("case_name", ["mlp", "batchnorm", "embedding_bag"])
def test_capture_gpu_parity(case_name: str) -> None:
    case = testing.REFERENCE_CASES[case_name]
    model = case.build(0).cuda()
    opt = testing.make_optimizer("adamw_amsgrad", model.parameters())
    ref, ref_opt = testing.clone_pair(model, "adamw_amsgrad")

    def to_cuda(batch):
        return {k: v.cuda() for k, v in batch.items()}

    step = capture_train_step(
        model, opt, case.loss_fn, to_cuda(case.make_batch(0)), overrides=case.overrides()
    )
    state = step.init_state(model, opt)
    assert all(t.is_cuda for t in state)
    for i in range(5):
        batch = to_cuda(case.make_batch(i))
        state, _ = step(state, batch)
        testing.eager_step(ref, ref_opt, case.loss_fn, batch)
    bad = testing.state_mismatches(
        step.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=1e-3, atol=1e-4
    )
    assert not bad, bad
