"""compile(step) on hand-built StepGraphs: numerics against eager torch, donation, state I/O, errors."""

from __future__ import annotations

import logging

import jax
import pytest
import torch
from recir.lower_tpu import TPUCompiledStep, TPUOptions, compile
from recir.transforms import CompiledStep, ConfigError, DataError
from torch import nn

pytestmark = pytest.mark.tpu

# XLA's CPU float32 kernels (fused, differently ordered reductions) differ from ATen's in the last
# bits; over 20 SGD steps on these tiny models the drift stays below ~1e-6, so 1e-5 absolute and
# 1e-4 relative catch any real bug (a wrong gradient moves parameters by ~1e-2 per step).
ATOL, RTOL = 1e-5, 1e-4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 1))


def _mse(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _batches(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(5, 6, generator=g), "y": torch.randn(5, 1, generator=g)} for _ in range(n)]


@pytest.mark.smoke
def test_sgd_matches_eager_torch_optim_for_20_steps(sgd_step):
    model = _mlp()
    batches = _batches(20)
    step = sgd_step(model, _mse, batches[0], lr=0.05)
    compiled = compile(step)
    assert isinstance(compiled, CompiledStep)
    state = compiled.init_state(model)

    eager = _mlp()
    opt = torch.optim.SGD(eager.parameters(), lr=0.05)
    for batch in batches:
        state, (loss,) = compiled(state, batch)
        opt.zero_grad()
        ref_loss = _mse(eager, batch)
        ref_loss.backward()
        opt.step()
        assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref_loss.detach(), atol=ATOL, rtol=RTOL)

    got = compiled.state_dict(state)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(got[f"param:{name}"], p.detach(), atol=ATOL, rtol=RTOL)
    assert compiled.compile_seconds > 0
    # the trace to StableHLO is one part of it, XLA's compile (or a cache load) the rest
    assert 0 < compiled.trace_seconds < compiled.compile_seconds


def test_state_is_donated_step_after_step(sgd_step):
    model = _mlp()
    batches = _batches(3)
    compiled = compile(sgd_step(model, _mse, batches[0]))
    state = compiled.init_state(model)
    assert all(isinstance(x, jax.Array) for x in state)
    for batch in batches:
        old = state
        state, _ = compiled(state, batch)
        assert all(x.is_deleted() for x in old), "the state buffers passed in must be donated"
        assert not any(x.is_deleted() for x in state)
    with pytest.raises(ConfigError, match="was donated to an earlier step"):
        compiled(old, batches[0])
    with pytest.raises(ConfigError, match="was donated to an earlier step"):
        compiled.state_dict(old)


def test_the_first_step_updates_init_state_and_loaded_state_in_place(sgd_step):
    # init_state's and load_state_dict's arrays are JAX's own buffers, not views of the torch tensors they
    # came from: a view cannot be donated, and the first step then allocated the whole state afresh (twice
    # the state's memory at that step's peak; full-size DLRMv3 on the TPU path: 0.76 GiB more)
    model = _mlp()
    batches = _batches(2)
    compiled = compile(sgd_step(model, _mse, batches[0]))
    params = {p.data_ptr() for p in model.parameters()}
    for state in (
        compiled.init_state(model),
        compiled.load_state_dict(compiled.state_dict(compiled.init_state(model))),
    ):
        assert not {x.unsafe_buffer_pointer() for x in state} & params
        before = [x.unsafe_buffer_pointer() for x in state]
        state, _ = compiled(state, batches[0])
        assert [x.unsafe_buffer_pointer() for x in state] == before, "updated in place from the first step"


def test_without_donation_inputs_survive(sgd_step):
    model = _mlp()
    batch = _batches(1)[0]
    compiled = compile(sgd_step(model, _mse, batch), options=TPUOptions(donate_state=False))
    state = compiled.init_state(model)
    new_state, _ = compiled(state, batch)
    assert not any(x.is_deleted() for x in state)
    assert len(new_state) == len(state)


@pytest.mark.smoke
def test_state_dict_round_trip_and_resume(sgd_step):
    model = _mlp()
    batches = _batches(4)
    step = sgd_step(model, _mse, batches[0])
    compiled = compile(step)
    state = compiled.init_state(model)
    for batch in batches[:2]:
        state, _ = compiled(state, batch)
    saved = compiled.state_dict(state)
    assert set(saved) == set(step.signature.state_names())
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in saved.values())

    resumed = compiled.load_state_dict(saved)
    for batch in batches[2:]:
        state, (loss_a,) = compiled(state, batch)
        resumed, (loss_b,) = compiled(resumed, batch)
        torch.testing.assert_close(loss_a, loss_b, atol=0, rtol=0)
    # the reference interpreter agrees with the compiled step from the same saved state
    ref = step.load_state_dict(saved)
    for batch in batches[2:]:
        ref, _ = step(ref, batch)
    for name, t in step.state_dict(ref).items():
        torch.testing.assert_close(compiled.state_dict(state)[name], t, atol=ATOL, rtol=RTOL)


def test_bad_batches_and_state_are_rejected(sgd_step):
    model = _mlp()
    batch = _batches(1)[0]
    compiled = compile(sgd_step(model, _mse, batch))
    state = compiled.init_state(model)
    with pytest.raises(DataError, match="expected float32\\[5, 6\\]"):
        compiled(state, {"x": torch.randn(4, 6), "y": torch.randn(4, 1)})
    with pytest.raises(ConfigError, match="state arrays"):
        compiled(state[:-1], batch)
    with pytest.raises(ConfigError, match="embedding backend 'fbgemm' cannot run on target 'tpu'"):
        compile(compiled.step, embedding_backend="fbgemm")


def test_logs_the_backend_and_lowers_to_stablehlo(sgd_step, caplog):
    model = _mlp()
    batch = _batches(1)[0]
    with caplog.at_level(logging.INFO, logger="recir.lower_tpu"):
        compiled = compile(sgd_step(model, _mse, batch))
    backend = jax.default_backend()
    expected = "lowering to TPU" if backend == "tpu" else f"running on JAX's {backend.upper()} backend"
    assert expected in caplog.text
    assert isinstance(compiled, TPUCompiledStep) and "compiled=False" in repr(compiled)
    text = compiled.lower().as_text()
    assert "stablehlo.dot_general" in text or "dot_general" in text
    assert compiled.compile_seconds == 0.0  # compiling waits for the first call


def _mse_plus_high_bits(model, batch):
    # batch["big"] holds int64 ids past 2**32: their high 32 bits survive only in 64-bit integers.
    return _mse(model, batch) + (batch["big"] >> 32).to(torch.float32).sum()


def test_x64_option_keeps_int64_exact(sgd_step):
    model = _mlp()
    batch = {**_batches(1)[0], "big": torch.tensor([3 * 2**32 + 5, 2**40 + 7, 2**33], dtype=torch.int64)}
    high_bits = 3 + 2**8 + 2
    want = _mse(model, batch).detach() + high_bits
    compiled = compile(sgd_step(model, _mse_plus_high_bits, batch), options=TPUOptions(x64=True))
    assert compiled.x64
    state = compiled.init_state(model)
    state, (loss,) = compiled(state, batch)
    assert loss.dtype == torch.float32 and state[0].dtype == jax.numpy.float32
    torch.testing.assert_close(loss, want, atol=ATOL, rtol=RTOL)
    assert not jax.config.read("jax_enable_x64"), "x64 must stay scoped to the compiled step"
    # the same step in 32 bits would lose the high bits: it refuses the batch instead of wrapping the values
    narrow = compile(sgd_step(model, _mse_plus_high_bits, batch), options=TPUOptions(x64=False))
    narrow_state = narrow.init_state(model)
    with pytest.raises(
        DataError, match=r"batch input '\w+' holds int64 values in \[8589934592, 1099511627783\].*x64=True"
    ):
        narrow(narrow_state, batch)
    # values that fit int32 run as before (their high bits: 0, -1 for -7, 0)
    small = {**batch, "big": torch.tensor([5, -7, 2**31 - 1], dtype=torch.int64)}
    _, (loss32,) = narrow(narrow_state, small)
    torch.testing.assert_close(loss32, _mse(model, small).detach() - 1, atol=ATOL, rtol=RTOL)


def test_init_state_releases_each_source_once_its_copy_exists(sgd_step):
    """``init_state(release=...)``: called once per state slot, in slot order, after that slot's array
    is copied; a caller that overwrites (or frees) the model's tensor there leaves the state intact."""
    torch.manual_seed(0)  # a 32 MiB weight: its copy takes long enough to be overtaken if not awaited
    model = nn.Sequential(nn.Linear(6, 2896), nn.ReLU(), nn.Linear(2896, 2896), nn.ReLU(), nn.Linear(2896, 1))
    batch = _batches(1)[0]
    compiled = compile(sgd_step(model, _mse, batch, lr=0.05))
    params = dict(model.named_parameters())
    expected = {f"param:{n}": p.detach().clone() for n, p in params.items()}
    released: list[str] = []

    def release(slot: str) -> None:
        released.append(slot)
        name = slot.removeprefix("param:")
        if name in params:
            with torch.no_grad():
                params[name].fill_(float("nan"))  # the source goes away; the copy must not see it

    state = compiled.init_state(model, release=release)
    assert released == [s.name for s in compiled.step.signature.state]
    got = compiled.state_dict(state)
    for slot, value in expected.items():
        torch.testing.assert_close(got[slot], value, rtol=0, atol=0)
    state, (loss,) = compiled(state, batch)
    assert torch.isfinite(loss)


def test_trim_host_heap_runs_where_there_is_glibc():
    import platform

    from recir.embedding import trim_host_heap

    assert trim_host_heap() is (platform.libc_ver()[0] == "glibc")


def test_each_call_makes_room_in_the_host_heap_for_xlas_temporaries(sgd_step, monkeypatch):
    """On JAX's CPU backend the step knows its temporaries' block (XLA's memory analysis) and, when it is
    large, asks recir.embedding.make_heap_room for that much before each call (here with the threshold
    lowered to this tiny step's block)."""
    import recir.lower_tpu._compile as lowering

    model = _mlp()
    batches = _batches(2)
    compiled = compile(sgd_step(model, _mse, batches[0], lr=0.05))
    asked: list[int] = []
    monkeypatch.setattr(lowering, "make_heap_room", lambda n: asked.append(n) or False)
    state = compiled.init_state(model)
    state, _ = compiled(state, batches[0])
    assert asked == []  # a few KiB: under the threshold, nothing to check
    temp = compiled._host_temp_bytes
    if jax.default_backend() != "cpu":  # a TPU's temporaries live in its HBM: nothing to check on the host
        assert temp == 0
        return
    assert temp == compiled._compiled.memory_analysis().temp_size_in_bytes > 0
    monkeypatch.setattr(lowering, "_HEAP_ROOM_MIN_BYTES", 1)
    state, _ = compiled(state, batches[1])
    assert asked == [temp]


def test_the_heap_is_trimmed_before_and_after_each_compile(sgd_step, monkeypatch):
    """A later token budget's step compiles beside the last call's freed temporaries (kept by the heap under
    retain_host_memory): the lowering hands the heap's free pages back before tracing, so the compiler's own
    temporaries do not come on top of them, and again after XLA's compile."""
    import recir.lower_tpu._compile as lowering

    model = _mlp()
    batch = _batches(1)[0]
    compiled = compile(sgd_step(model, _mse, batch, lr=0.05))
    events: list[str] = []
    monkeypatch.setattr(lowering, "trim_host_heap", lambda: events.append("trim") or True)
    lower = compiled._jitted.lower
    monkeypatch.setattr(
        compiled, "_jitted", type("J", (), {"lower": lambda self, *a: events.append("lower") or lower(*a)})()
    )
    state = compiled.init_state(model)
    events.clear()  # init_state trims too
    compiled(state, batch)
    assert events == ["trim", "lower", "trim"]


def test_cpu_scheduler_memory_keeps_fewer_temporaries_and_trains_the_same(sgd_step):
    """TPUOptions.cpu_scheduler (XLA:CPU's xla_cpu_scheduler_type): the default, ``memory``, orders the step
    so that its one block of temporaries is smaller than under XLA's concurrency-optimised order, and both
    orders train the same parameters (scheduling moves no arithmetic)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64)]
    model = nn.Sequential(*layers, nn.Linear(64, 1))
    g = torch.Generator().manual_seed(3)
    batches = [
        {"x": torch.randn(256, 64, generator=g), "y": torch.randn(256, 1, generator=g)} for _ in range(3)
    ]
    temps, params = {}, {}
    for scheduler in ("memory", "concurrency"):
        options = TPUOptions(cpu_scheduler=scheduler, persistent_cache=False)
        compiled = compile(sgd_step(model, _mse, batches[0], lr=0.05), options=options)
        state = compiled.init_state(model)
        for b in batches:
            state, _ = compiled(state, b)
        temps[scheduler] = compiled._host_temp_bytes
        params[scheduler] = compiled.state_dict(state)
    for name, value in params["memory"].items():
        torch.testing.assert_close(value, params["concurrency"][name], rtol=0, atol=1e-6, msg=name)
    if jax.default_backend() == "cpu":  # a TPU ignores the option (its temporaries live in HBM)
        assert 0 < temps["memory"] < temps["concurrency"], temps
    with pytest.raises(ConfigError, match=r"cpu_scheduler='fast'.*memory, concurrency"):
        TPUOptions(cpu_scheduler="fast")


def test_state_past_int32_without_x64_is_refused_by_name():
    from recir.capture import capture_train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))  # num_batches_tracked: an int64 buffer
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.randn(8, 4)}
    step = capture_train_step(model, opt, lambda m, b: m(b["x"]).square().mean(), batch)
    compiled = compile(step)
    assert not compiled.x64  # no rng, no 64-bit constants
    state = step.state_dict(step.init_state(model, opt))
    name = next(k for k in state if k.endswith("num_batches_tracked"))
    state[name] = torch.tensor(2**40, dtype=torch.int64)
    with pytest.raises(DataError, match=rf"state slot '{name}' holds int64 values in \[1099511627776, "):
        compiled.load_state_dict(state)
    state[name] = torch.tensor(5, dtype=torch.int64)  # fits: loads and trains
    new_state, _ = compiled(compiled.load_state_dict(state), batch)
    assert compiled.state_dict(new_state)[name].item() == 6  # counted on in int32, back as int64


def test_baked_state_past_int32_without_x64_is_refused_by_name(tmp_path):
    """export(baked_state=) bakes int64 state as int32 constants when x64 is off: out of range, DataError."""
    from recir.capture import capture_train_step

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, lambda m, b: m(b["x"]).square().mean(), {"x": torch.randn(8, 4)})
    compiled = compile(step)
    assert not compiled.x64
    baked = [t.clone() for t in step.init_state(model, opt)]
    index = next(i for i, s in enumerate(step.signature.state) if s.name.endswith("num_batches_tracked"))
    baked[index] = torch.tensor(2**40, dtype=torch.int64)
    name = step.signature.state[index].name
    with pytest.raises(
        DataError, match=rf"baked state slot '{name}' holds int64 values in \[1099511627776, "
    ):
        compiled.export(tmp_path / "step.jax", baked_state=baked)
    assert not (tmp_path / "step.jax").exists()
    baked[index] = torch.tensor(5, dtype=torch.int64)
    compiled.export(tmp_path / "step.jax", baked_state=baked)
    assert (tmp_path / "step.jax").exists()
