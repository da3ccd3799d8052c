"""Cross-backend parity: the same captured step lowered by recir.lower_gpu (Inductor, here on the CPU
device when no CUDA is present) and by recir.lower_tpu (torchax -> XLA) gives the same state.

Tolerances (rtol=1e-4, atol=1e-5): two different float32 compilers (Inductor's C++/Triton kernels and
XLA's) fuse and reorder reductions differently; over 10 steps their results agree to ~1e-6, while a
lowering bug in either moves some slot by >1e-3.
"""

from __future__ import annotations

import pytest
import torch
from recir.capture import capture_train_step, testing
from recir.lower_tpu import compile as compile_tpu

lower_gpu = pytest.importorskip("recir.lower_gpu", reason="recir-lower-gpu is not installed")
if not hasattr(lower_gpu, "compile"):  # pragma: no cover - before recir-lower-gpu's compile landed
    pytest.skip("recir.lower_gpu.compile is not available yet", allow_module_level=True)

# Not marked `tpu`: it is about the two lowerings agreeing, not about JAX devices (and Inductor
# compiles are slow); the cpu session runs it.

RTOL, ATOL = 1e-4, 1e-5
STEPS = 10


def _capture(case_name: str, opt_name: str):
    case = testing.REFERENCE_CASES[case_name]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    return case, model, optimizer, step


# Both lowerings run recir-embedding's prepare_for_lowering with its defaults (row-wise table updates),
# so they compute the same (lazy, for Adam) maths; the parity tests compare each with eager torch.optim.
@pytest.mark.parametrize(("case_name", "opt_name"), [("mlp", "adam"), ("embedding_bag", "adagrad")])
def test_gpu_and_tpu_lowerings_agree(case_name: str, opt_name: str) -> None:
    case, model, optimizer, step = _capture(case_name, opt_name)
    # each backend gets its own capture: a lowering may rewrite the graph it is given
    gpu = lower_gpu.compile(_capture(case_name, opt_name)[3])
    tpu = compile_tpu(step)
    g_state = gpu.init_state(model, optimizer)
    t_state = tpu.init_state(model, optimizer)
    for i in range(STEPS):
        batch = case.make_batch(i)
        g_state, g_out = gpu(g_state, batch)
        t_state, t_out = tpu(t_state, batch)
        torch.testing.assert_close(t_out[0].cpu(), g_out[0].detach().cpu(), rtol=RTOL, atol=ATOL)
    g_sd = {k: v.detach().cpu() for k, v in gpu.state_dict(g_state).items()}
    t_sd = tpu.state_dict(t_state)
    assert set(g_sd) == set(t_sd)
    bad = testing.state_mismatches(t_sd, g_sd, rtol=RTOL, atol=ATOL)
    assert not bad, f"the GPU and TPU lowerings disagree after {STEPS} steps: {bad}"
