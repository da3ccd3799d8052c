"""compile(step) on the CPU device: numerics against eager torch.optim, in-place state, state round trips.

Uses a StepGraph built by hand (make_fx of a pure SGD-with-momentum step); each Inductor compile is
several seconds on 2 cores, so one compiled step per module is reused across assertions.
"""

from __future__ import annotations

import logging

import pytest
import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph
from recir.transforms import CompiledStep, ConfigError, DataError

LR, MOMENTUM, STEPS = 0.05, 0.9, 20
# Inductor reorders fp32 reductions (vectorised sums) and fuses the update arithmetic, so each step
# differs from eager by a few ulps; over 20 steps of a well-conditioned tiny MLP that stays below 1e-5.
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def mlp(lower_gpu_cache_dir):
    torch.manual_seed(0)
    model = TinyMLP()
    step = sgd_step_graph(model, mse_loss, mlp_batch(0), lr=LR, momentum=MOMENTUM)
    compiled = lg.compile(step, device="cpu", options=lg.GPUOptions(cache_dir=lower_gpu_cache_dir))
    return model, step, compiled


def test_compiled_step_matches_eager_torch_optim_and_updates_in_place(mlp):
    model, step, compiled = mlp
    assert isinstance(compiled, CompiledStep)
    assert compiled.compile_seconds > 0 and compiled.device == torch.device("cpu")
    eager = TinyMLP()
    eager.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(eager.parameters(), lr=LR, momentum=MOMENTUM)

    state = compiled.init_state(model, None)
    assert all(s.data_ptr() != p.data_ptr() for s, p in zip(state, model.parameters()))  # never aliases
    ptrs = [t.data_ptr() for t in state]
    for i in range(STEPS):
        batch = mlp_batch(i)
        opt.zero_grad()
        loss = mse_loss(eager, batch)
        loss.backward()
        opt.step()
        new_state, outputs = compiled(state, batch)
        assert new_state is state  # in place: the same list, the same storage
        assert [t.data_ptr() for t in state] == ptrs, f"state moved at step {i}"
        torch.testing.assert_close(outputs[0], loss.detach(), rtol=RTOL, atol=ATOL)
    sd = compiled.state_dict(state)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(sd[f"param:{name}"], p.detach(), rtol=RTOL, atol=ATOL, msg=name)
        buf = opt.state[p]["momentum_buffer"]
        torch.testing.assert_close(sd[f"optim:{name}:momentum_buffer"], buf, rtol=RTOL, atol=ATOL, msg=name)


def test_init_state_share_model_trains_the_model_itself(mlp):
    model, step, compiled = mlp
    shared = TinyMLP()
    shared.load_state_dict(model.state_dict())
    state = compiled.init_state(shared, None, share_model=True)
    params = dict(shared.named_parameters())
    sd = compiled.state_dict(state)
    for name, p in params.items():  # the state is the model's storage, not a copy
        assert sd[f"param:{name}"].data_ptr() == p.data_ptr(), name
    assert sd["optim:fc1.weight:momentum_buffer"].abs().sum() == 0  # optimizer slots are fresh
    copied = compiled.init_state(model, None)
    for i in range(3):
        state, _ = compiled(state, mlp_batch(i))
        copied, _ = compiled(copied, mlp_batch(i))
    for name, p in params.items():  # the model holds the trained values, the same as a copied state's
        assert torch.equal(p.detach(), compiled.state_dict(copied)[f"param:{name}"]), name
    assert not torch.equal(params["fc1.weight"].detach(), model.fc1.weight.detach())  # it trained
    out_of_place = lg.compile(step, device="cpu", options=lg.GPUOptions(in_place=False, cache=False))
    with pytest.raises(ConfigError, match=r"share_model=True\) needs GPUOptions\(in_place=True\)"):
        out_of_place.init_state(shared, None, share_model=True)


def test_load_state_dict_copies_and_resumes(mlp):
    model, step, compiled = mlp
    state = compiled.init_state(model, None)
    for i in range(2):
        state, _ = compiled(state, mlp_batch(i))
    snapshot = {k: v.clone() for k, v in compiled.state_dict(state).items()}
    resumed = compiled.load_state_dict(snapshot)
    assert all(r.data_ptr() != s.data_ptr() for r, s in zip(resumed, snapshot.values()))
    for i in range(2, 4):
        state, out_a = compiled(state, mlp_batch(i))
        resumed, out_b = compiled(resumed, mlp_batch(i))
        assert torch.equal(out_a[0], out_b[0])
    for a, b in zip(state, resumed):
        assert torch.equal(a, b)
    # load_state_dict copied: stepping never touched the snapshot it was given.
    assert not torch.equal(snapshot["param:fc1.weight"], state[0])


def test_reference_interpreter_agrees(mlp):
    model, step, compiled = mlp
    state = compiled.init_state(model, None)
    ref = step.init_state(model, None)
    for i in range(3):
        ref, ref_out = step(ref, mlp_batch(i))
        state, out = compiled(state, mlp_batch(i))
        torch.testing.assert_close(out[0], ref_out[0], rtol=RTOL, atol=ATOL)
    for a, b in zip(state, ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_bad_state_and_batch_are_rejected(mlp):
    model, step, compiled = mlp
    state = compiled.init_state(model, None)
    with pytest.raises(ConfigError, match="expects 8 state tensors"):
        compiled(state[:-1], mlp_batch(0))
    with pytest.raises(ConfigError, match="param:fc1.weight"):
        compiled([state[0].double(), *state[1:]], mlp_batch(0))
    with pytest.raises(DataError, match="expected float32\\[4, 8\\]"):
        compiled(state, mlp_batch(0, n=5))


def test_out_of_place_option(lower_gpu_cache_dir, caplog):
    torch.manual_seed(1)
    model = TinyMLP()
    step = sgd_step_graph(model, mse_loss, mlp_batch(0), lr=LR, momentum=MOMENTUM)
    opts = lg.GPUOptions(in_place=False, cache_dir=lower_gpu_cache_dir)
    with caplog.at_level(logging.INFO, logger="recir.lower_gpu"):
        compiled = lg.compile(step, device="cpu", options=opts)
    assert "with Inductor for the CPU device" in caplog.text
    state = compiled.init_state(model, None)
    before = [t.clone() for t in state]
    new_state, _ = compiled(state, mlp_batch(0))
    assert new_state is not state
    assert all(torch.equal(a, b) for a, b in zip(state, before))  # the input state is untouched
    ref, _ = step(before, mlp_batch(0))
    for a, b in zip(new_state, ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
