"""Randomness is carried in ``rng:seed``/``rng:offset`` state: a step is a pure function of its inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from recir.capture import capture_train_step, testing
from torch import nn


class _Dropper(nn.Module):
    def __init__(self, n: int = 2000, p: float = 0.3) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.w * x, self.p, self.training)


def _loss(m: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    out = m(b["x"])
    return out.sum(), out


def _capture(model: nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.ones(model.w.shape[0])}
    return capture_train_step(model, opt, _loss, batch), opt, batch


def test_capture_rng_slots_and_reproducibility() -> None:
    model = _Dropper()
    step, opt, batch = _capture(model)
    names = step.signature.state_names()
    assert names[-2:] == ["rng:seed", "rng:offset"]
    assert [s.kind for s in step.signature.state[-2:]] == ["rng", "rng"]
    assert step.meta["recir.random_ops"] == ["dropout"]
    state = step.init_state(model, opt)
    a_state, (_, a) = step(state, batch)
    b_state, (_, b) = step(state, batch)
    assert torch.equal(a, b)  # same state in, same mask out
    assert int(a_state[-1]) == int(state[-1]) + 1  # the offset advances per step
    _, (_, c) = step(a_state, batch)
    assert not torch.equal(a == 0, c == 0)  # the next step draws a new mask
    other = list(state)
    other[names.index("rng:seed")] = torch.tensor(12345)
    _, (_, d) = step(other, batch)
    assert not torch.equal(a == 0, d == 0)  # another seed, another mask


def test_capture_rng_dropout_statistics_and_gradient_mask() -> None:
    p = 0.3
    model = _Dropper(p=p)
    step, opt, batch = _capture(model)
    state = step.init_state(model, opt)
    grads = testing.captured_gradients(step, state, batch)["param:w"]
    _, (_, out) = step(state, batch)
    dropped = out == 0
    assert abs(dropped.float().mean().item() - p) < 0.04
    kept = ~dropped
    torch.testing.assert_close(out[kept], (model.w.detach() / (1 - p))[kept])
    # the backward uses the forward's mask: zero gradient exactly where the output was dropped
    assert torch.all(grads[dropped] == 0)
    torch.testing.assert_close(grads[kept], torch.full_like(grads[kept], 1 / (1 - p)))


def test_capture_rng_each_random_op_is_one_counter_uniform_node() -> None:
    """A random op's values are one ``recir::counter_uniform`` node (each lowering computes the hash its
    own way), equal to its ATen reference; the verifier accepts it (INV-6)."""
    from recir.capture._rng import counter_uniform_reference
    from recir.transforms import verify

    model = testing.TransformerBlock(dropout=0.2)
    case = testing.REFERENCE_CASES["transformer"]
    step = capture_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), case.loss_fn, case.make_batch(0)
    )
    nodes = [n for n in step.graph.nodes if n.target is torch.ops.recir.counter_uniform.default]
    assert len(nodes) == len(step.meta["recir.random_ops"]) >= 2
    ranges = sorted((n.args[1], n.args[1] + n.args[2]) for n in nodes)
    assert all(end <= start for (_, end), (start, _) in zip(ranges, ranges[1:]))  # disjoint counters
    verify(step)
    key = torch.tensor(2**33 + 12345)  # the op reads the key's low 32 bits
    u = torch.ops.recir.counter_uniform.default(key, 2**32 - 3, 1000)
    assert u.dtype == torch.float32 and u.shape == (1000,)
    assert torch.equal(u, counter_uniform_reference(key, 2**32 - 3, 1000))


def test_capture_rng_absent_without_randomness() -> None:
    model = testing.TransformerBlock(dropout=0.2)
    model.eval()  # dropout off: no random op, no rng slots
    case = testing.REFERENCE_CASES["transformer"]
    step = capture_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), case.loss_fn, case.make_batch(0)
    )
    assert not [s for s in step.signature.state if s.kind == "rng"]
    model.train()
    step = capture_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), case.loss_fn, case.make_batch(0)
    )
    assert [s.name for s in step.signature.state if s.kind == "rng"] == ["rng:seed", "rng:offset"]


def test_capture_rng_rand_and_randn() -> None:
    class Noise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4000))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w * x + torch.randn_like(x) + torch.rand(x.shape[0])

    model = Noise()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = {"x": torch.zeros(4000)}
    step = capture_train_step(model, opt, _loss, batch)
    assert step.meta["recir.random_ops"] == ["randn_like", "rand"]
    state = step.init_state(model, opt)
    _, (_, out) = step(state, batch)
    # N(0,1) + U[0,1): mean 0.5, variance 1 + 1/12
    assert abs(out.mean().item() - 0.5) < 0.1
    assert abs(out.var().item() - (1 + 1 / 12)) < 0.15


def test_capture_rng_bits_match_under_inductor_including_scalar_tails() -> None:
    """Inductor's C++ must give the interpreter's bits, also in the scalar tail of a vectorised loop
    (5003 = 312 x 16 + 11). Why the hash stays in masked int64: a wrapping-int32 version matched
    in the vector lanes and returned garbage in the tail (signed overflow is undefined in C++). The GPU
    path gives Inductor recir::counter_uniform's reference, the maths compiled here."""
    from recir.capture._rng import counter_uniform_reference

    def draw(key: torch.Tensor) -> torch.Tensor:
        return counter_uniform_reference(key, 2**31 - 1000, 5003)

    key = torch.tensor(2**32 - 7)
    assert torch.equal(torch.compile(draw, fullgraph=True)(key), draw(key))


def test_capture_rng_streams_of_successive_steps_are_uncorrelated() -> None:
    from recir.capture._rng import step_key, uniform

    seed = torch.tensor(7)
    draws = [uniform(step_key(seed, torch.tensor(off)), 0, (50_000,), torch.float32) for off in range(4)]
    for u in draws:
        assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
        assert u.unique().numel() > 49_000  # one bijective mix per counter: (almost) no repeats
    for a, b in zip(draws, draws[1:]):
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02
        # the same values in another order would pass the correlation test: they must differ as sets
        assert not torch.equal(a.sort().values, b.sort().values)


def test_capture_tags_each_dropout_keep_mask() -> None:
    # recir.rng_mask marks the boolean mask of each dropout (lowerings store it once), nothing else
    from recir.transforms import RNG_MASK_KEY

    model = testing.TransformerBlock(dropout=0.2)  # two dropouts per forward
    case = testing.REFERENCE_CASES["transformer"]
    step = capture_train_step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), case.loss_fn, case.make_batch(0)
    )
    tagged = [n for n in step.graph.nodes if RNG_MASK_KEY in n.meta]
    assert len(tagged) == 2
    assert all(n.meta["val"].dtype == torch.bool and n.meta[RNG_MASK_KEY] == "dropout" for n in tagged)
