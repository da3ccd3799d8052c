"""TorchRec batches as they are: KeyedJaggedTensors (and TorchRec's Batch dataclass) in the example batch
and in every call of a captured step, converted at the boundary; BucketedStep captures once per bucket.
Parameters are compared with the plain-PyTorch twin trained eagerly on the same KJTs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from recir.capture import BucketedStep, capture_train_step
from recir.embedding import AutoBuckets, JaggedBatch, bucketize, overrides, suggest_buckets
from recir.transforms import ConfigError, DataError

LR = 0.1


def _kjt_batch(helpers, gen):
    kjt = helpers.random_kjt(gen)
    return {"features": kjt, "y": torch.randn(helpers.B, generator=gen)}


def _check_tables(helpers, sd, ref, where):
    for table in ("t1", "t2", "s1"):
        for name, want in ref.state_of(table).items():
            torch.testing.assert_close(sd[name], want, rtol=1e-5, atol=1e-6, msg=f"{name}, {where}")


def test_kjt_batches_are_captured_and_called_as_they_are(helpers):
    model = helpers.make_torchrec_model()
    ref = helpers.make_reference(model, "sgd", {"lr": LR})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)
    example = _kjt_batch(helpers, gen)
    step = capture_train_step(model, opt, helpers.loss_fn, example, overrides=overrides(), batch_buckets=[16])
    # the captured batch is the static layout: one values and one lengths leaf, every feature 16 ids
    assert [s.shape for s in step.signature.batch] == [(64,), (16,), (4,)]
    state = step.init_state(model, opt)
    for i in range(6):
        batch = _kjt_batch(helpers, gen)
        state, (loss,) = step(state, batch)  # a KeyedJaggedTensor, as the loader gave it
        ref_loss = ref.step(batch["features"], batch["y"])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"loss, step {i}")
    _check_tables(helpers, step.state_dict(state), ref, "after 6 steps")


def test_a_kjt_past_the_captured_bucket_names_the_feature_and_the_fix(helpers):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = helpers.make_torchrec_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(3)
    step = capture_train_step(
        model, opt, helpers.loss_fn, _kjt_batch(helpers, gen), overrides=overrides(), batch_buckets=[16]
    )
    state = step.init_state(model, opt)
    lengths = torch.tensor([5, 5, 5, 5] + [1] * 12)  # f1 has 20 ids: more than its 16 slots
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2", "f3", "q"], values=torch.zeros(32, dtype=torch.int64), lengths=lengths
    )
    with pytest.raises(DataError, match=r"feature 'f1': 20 ids do not fit its capacity 16.*BucketedStep"):
        step(state, {"features": kjt, "y": torch.zeros(4)})


def test_bucketed_step_captures_once_per_bucket_and_matches_eager(helpers):
    model = helpers.make_torchrec_model()
    ref = helpers.make_reference(model, "sgd", {"lr": LR})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    trainer = BucketedStep(model, opt, helpers.loss_fn, overrides=overrides())
    gen = torch.Generator().manual_seed(5)
    batches = [_kjt_batch(helpers, gen) for _ in range(8)]
    state = trainer.init_state(batches[0])
    seen = set()
    for i, batch in enumerate(batches):
        state, (loss,) = trainer(state, batch)
        ref_loss = ref.step(batch["features"], batch["y"])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"loss, step {i}")
        counts = batch["features"].lengths().view(4, helpers.B).sum(1).tolist()
        seen.add(
            tuple(max(8, 1 << (max(n, 1) - 1).bit_length()) for n in counts)
        )  # default: powers of two >= 8
    assert trainer.compiles == len(seen) >= 2, (trainer.compiles, seen)
    real, padded = trainer.padding
    assert real == sum(int(b["features"].lengths().sum()) for b in batches) and padded > 0
    # bucket feedback: the sizes it saw, and buckets from them that pad less at no more compiles
    sizes = {k: [] for k in ("f1", "f2", "f3", "q")}
    for b in batches:
        for k, n in zip(sizes, b["features"].lengths().view(4, helpers.B).sum(1).tolist()):
            sizes[k].append(n)
    assert {k: dict(v) for k, v in trainer.sizes.items()} == {k: dict(Counter(v)) for k, v in sizes.items()}
    suggestion = suggest_buckets(trainer.sizes, max_buckets=2, multiple_of=1)
    assert suggestion.waste_after < suggestion.waste_before == pytest.approx(padded / real)
    retrained = BucketedStep(
        model, opt, helpers.loss_fn, overrides=overrides(), batch_buckets=suggestion.buckets
    )
    state2 = retrained.init_state(batches[0])
    for batch in batches:
        state2, _ = retrained(state2, batch)
    assert retrained.padding_waste == pytest.approx(suggestion.waste_after)
    last = next(iter(trainer._steps.values()))
    _check_tables(helpers, last.state_dict(state), ref, "after 8 steps")


def test_auto_buckets_learn_after_a_window_and_keep_the_numbers(helpers):
    """``--buckets auto``: powers of two for the window, then suggest_buckets' buckets (a larger batch
    than any seen still gets a power of two); the losses and tables equal eager's throughout."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    model = helpers.make_torchrec_model()
    ref = helpers.make_reference(model, "sgd", {"lr": LR})
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    policy = AutoBuckets(window=4, max_buckets=2, multiple_of=1)
    trainer = BucketedStep(model, opt, helpers.loss_fn, overrides=overrides(), batch_buckets=policy)
    gen = torch.Generator().manual_seed(11)
    batches = [_kjt_batch(helpers, gen) for _ in range(8)]
    big = torch.tensor([4] * helpers.B + [1] * 3 * helpers.B)  # f1: 16 ids, more than any batch above
    kjt = KeyedJaggedTensor(keys=["f1", "f2", "f3", "q"], values=torch.arange(28) % 4, lengths=big)
    batches.append({"features": kjt, "y": torch.randn(helpers.B, generator=gen)})
    state = trainer.init_state(batches[0])
    for i, batch in enumerate(batches):
        counts = batch["features"].lengths().view(4, helpers.B).sum(1).tolist()
        _, static = trainer.step_for(batch)
        caps = static["features"].capacities
        if i < policy.window:
            assert policy.suggestion is None
            assert list(caps) == [bucketize(n) for n in counts], (i, caps)  # powers of two >= 8
        else:
            learned = policy.suggestion.buckets
            for key, n, cap in zip(("f1", "f2", "f3", "q"), counts, caps):
                want = min([b for b in learned[key] if b >= n], default=1 << (n - 1).bit_length())
                assert cap == want, (i, key, n, cap, learned[key])
        state, (loss,) = trainer(state, batch)
        ref_loss = ref.step(batch["features"], batch["y"])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"loss, step {i}")
    suggestion = policy.suggestion
    assert suggestion is not None and suggestion.waste_after < suggestion.waste_before
    assert caps[0] == 16 and 16 not in suggestion.buckets["f1"]  # the big batch: a power of two, no error
    assert trainer.batches == len(batches)
    last = trainer.step_for(batches[-1])[0]
    _check_tables(helpers, last.state_dict(state), ref, "after 9 steps")
    with pytest.raises(ConfigError, match="window, max_buckets and multiple_of must be >= 1.*window=0"):
        AutoBuckets(window=0)
    with pytest.raises(ConfigError, match="max_buckets=0"):
        AutoBuckets(max_buckets=0)


def test_torchrec_batch_dataclass_is_accepted(helpers):
    from torchrec.datasets.utils import Batch

    def loss_fn(model, batch):
        pooled, seq = model(batch.sparse_features)
        return (pooled.tanh().sum(1) + batch.dense_features.sum(1) - batch.labels).pow(
            2
        ).mean() + seq.sin().sum() * 0.1

    model = helpers.make_torchrec_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(9)

    def make():
        return Batch(torch.randn(4, 2, generator=gen), helpers.random_kjt(gen), torch.randn(4, generator=gen))

    step = capture_train_step(model, opt, loss_fn, make(), overrides=overrides(), batch_buckets=[16])
    state = step.init_state(model, opt)
    for _ in range(2):
        state, (loss,) = step(state, make())
        assert torch.isfinite(loss)
    assert isinstance(
        step.signature.unflatten_batch([s for s in step.signature.batch]).sparse_features, JaggedBatch
    )


def test_without_the_adapter_a_kjt_is_one_clear_capture_error(helpers, monkeypatch):
    from recir.capture import CaptureError
    from recir.transforms import _batch_adapters

    monkeypatch.setattr(_batch_adapters, "_ADAPTERS", [])
    model = helpers.make_torchrec_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(
        CaptureError, match="KeyedJaggedTensor, and no batch adapter converts it.*import recir.embedding"
    ):
        capture_train_step(
            model, opt, helpers.loss_fn, _kjt_batch(helpers, torch.Generator()), overrides=overrides()
        )
