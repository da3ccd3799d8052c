"""JaggedBatch (KJT round trip, pytree spec), bucketing with pad-waste reports, and every bad-input case."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.utils._pytree as pytree
from recir.embedding import (
    DataError,
    EmbeddingTable,
    JaggedBatch,
    bucketize,
    checks,
    checks_enabled,
    overrides,
    pad_to_bucket,
    validate_batch,
    validate_step_batch,
)
from recir.embedding._testing import build_step
from recir.transforms import apply_overrides

TABLES = [EmbeddingTable("t1", 10, 4, ("f1", "f2")), EmbeddingTable("t2", 5, 2, ("f3",), pooling="mean")]


def kjt(values, lengths, keys=("f1", "f2", "f3")):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(keys=list(keys), values=torch.tensor(values), lengths=torch.tensor(lengths))


def test_round_trip_and_static_pytree_spec():
    k = kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, 2, 0, 1])  # B=2
    jb = JaggedBatch.from_kjt(k, [4, 4, 2])
    assert jb.values().tolist() == [1, 2, 1, 1, 3, 4, 4, 3, 0, 0]  # padding repeats the feature's first id
    back = jb.to_kjt()
    assert back.values().tolist() == k.values().tolist() and back.lengths().tolist() == k.lengths().tolist()
    leaves, spec = pytree.tree_flatten({"x": jb})
    assert [t.shape for t in leaves] == [(10,), (6,)]
    rebuilt = pytree.tree_unflatten(leaves, spec)["x"]
    assert rebuilt.keys() == ["f1", "f2", "f3"] and rebuilt.capacities == (4, 4, 2)
    # different real lengths, same bucket -> same spec (one compile per bucket)
    other = JaggedBatch.from_kjt(kjt([5, 6, 7, 8, 1], [1, 1, 1, 1, 0, 1]), [4, 4, 2])
    assert pytree.tree_flatten({"x": other})[1] == spec


def test_bucketize_and_pad_waste_report(caplog):
    assert [bucketize(n) for n in (0, 1, 8, 9, 100)] == [8, 8, 8, 16, 128]
    assert bucketize(5, [4, 6, 12]) == 6
    k = kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, 2, 0, 1])
    with caplog.at_level(logging.INFO, logger="recir.embedding"):
        jb, report = pad_to_bucket(k, min_size=4, tables=TABLES)
    assert jb.capacities == (4, 4, 4)
    assert report.real == {"f1": 2, "f2": 3, "f3": 1}
    assert report.padded == 6 and report.waste == pytest.approx(1.0)
    assert "pad waste 100.0%" in caplog.text
    jb2, _ = pad_to_bucket(k, {"f1": [2], "f2": [3], "f3": [1]})
    assert jb2.capacities == (2, 3, 1)


def test_bad_inputs_raise_data_error_naming_the_culprit():
    good = JaggedBatch.from_kjt(kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, 2, 0, 1]), [4, 4, 2])
    validate_batch(good, TABLES, expected_keys=["f1", "f2", "f3"])
    # id outside [0, rows): table, feature, value and batch position
    bad = JaggedBatch.from_kjt(kjt([1, 2, 3, 4, 4, 7], [2, 0, 1, 2, 0, 1]), [4, 4, 2])
    with pytest.raises(DataError, match=r"table 't2' \(feature 'f3'\): id 7 at batch position 1 .*\[0, 5\)"):
        validate_batch(bad, TABLES)
    with pytest.raises(DataError, match=r"table 't1' \(feature 'f2'\): id -3 at batch position 0"):
        JaggedBatch.from_kjt(kjt([1, 2, -3, 4, 4, 0], [2, 0, 1, 2, 0, 1]), tables=TABLES)
    # negative length
    with pytest.raises(DataError, match=r"feature 'f2': length -1 at batch position 1 is negative"):
        JaggedBatch.from_kjt(kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, -1, 0, 3]))
    # lengths whose sum differs from the number of values
    with pytest.raises(DataError, match=r"lengths sum to 7 but there are 6 values"):
        JaggedBatch.from_kjt(kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, 2, 0, 2]))
    # a feature with no table
    with pytest.raises(DataError, match=r"feature 'zz' has no table"):
        validate_batch(JaggedBatch.from_kjt(kjt([1, 2], [1, 1], keys=("zz",))), TABLES)
    # keys differing from the captured ones
    with pytest.raises(DataError, match=r"missing feature 'f3'"):
        validate_batch(JaggedBatch.from_kjt(kjt([1, 2], [1, 1], keys=("f1",))), expected_keys=["f1", "f3"])
    with pytest.raises(DataError, match=r"feature 'f2' at key position 0, captured 'f1'"):
        validate_batch(
            JaggedBatch.from_kjt(kjt([1, 2], [1, 1, 0, 0], keys=("f2", "f1"))), expected_keys=["f1", "f2"]
        )


def test_checks_can_be_turned_off(monkeypatch):
    bad = kjt([1, 2, 3, 4, 4, 9], [2, 0, 1, 2, 0, 1])  # id 9 is outside t2's 5 rows
    with pytest.raises(DataError):
        pad_to_bucket(bad, tables=TABLES)
    with checks(False):
        assert not checks_enabled()
        pad_to_bucket(bad, tables=TABLES)  # not checked
    monkeypatch.setenv("RECIR_EMBEDDING_CHECKS", "0")
    assert not checks_enabled()
    monkeypatch.setenv("RECIR_EMBEDDING_CHECKS", "1")
    assert checks_enabled()


def test_captured_step_checks_every_batch_at_run_time(helpers):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    gen = torch.Generator().manual_seed(0)
    batch, _ = helpers.random_batch(gen)
    step = build_step(model, helpers.loss_fn, batch, "sgd")
    state = step.init_state(model)
    step(state, batch)
    jb = batch["features"]
    values = jb.values().clone()
    start = jb.starts()[jb.index("f3")]
    values[start] = 99  # t2 has 12 rows
    f3_len = jb.segment("f3")[1]
    pos = int((f3_len > 0).nonzero()[0, 0])
    broken = {**batch, "features": JaggedBatch(jb.keys(), values, jb.lengths(), jb.batch_size, jb.capacities)}
    with pytest.raises(DataError, match=rf"table 't2' \(feature 'f3'\): id 99 at batch position {pos}"):
        step(state, broken)
    # keys differing from the captured ones: the batch structure no longer matches
    other = JaggedBatch(["f1", "f2", "q", "f3"], jb.values(), jb.lengths(), jb.batch_size, jb.capacities)
    with pytest.raises(DataError, match="differs from the captured one"):
        step(state, {**batch, "features": other})
    with pytest.raises(DataError, match=r"feature 'q' at key position 2, captured 'f3'"):
        validate_step_batch(step, {**batch, "features": other})
    validate_step_batch(step, batch)
    wider = JaggedBatch.from_kjt(jb.to_kjt(), [32] * 4)
    with pytest.raises(DataError, match=r"feature 'f1': capacity 32 differs from the captured 16"):
        validate_step_batch(step, {**batch, "features": wider})
    # captured with checks off: no check node, no error at run time (the lookup then fails or not)
    with checks(False):
        fast = build_step(model, helpers.loss_fn, batch, "sgd")
    assert not [n for n in fast.graph.nodes if "check_jagged" in str(n.target)]


def test_jagged_tensor_mapping():
    k = kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, 2, 0, 1])
    jts = JaggedBatch.from_kjt(k, [4, 4, 2]).to_jagged_tensors()
    assert sorted(jts) == ["f1", "f2", "f3"]
    assert jts["f2"].values().tolist() == [3, 4, 4] and jts["f2"].lengths().tolist() == [1, 2]
    back = JaggedBatch.from_jagged_tensors(jts, {"f1": 2, "f2": 4, "f3": 1})
    assert back.capacities == (2, 4, 1) and back.to_kjt().values().tolist() == k.values().tolist()


def _per_sample(jb):
    """``{feature: [ids of sample 0], [ids of sample 1], ...}`` (padding stripped), plus weights."""
    out = {}
    for key, jt in jb.to_jagged_tensors().items():
        w = jt.weights_or_none()
        out[key] = [
            (ids.tolist(), None if w is None else w[o : o + len(ids)].tolist())
            for ids, o in zip(jt.to_dense(), jt.offsets()[:-1].tolist())
        ]
    return out


@pytest.mark.parametrize("weighted", [False, True])
def test_split_samples_round_trips_with_static_shapes(weighted):
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 4, (3 * 6,), generator=gen)
    n = int(lengths.sum())
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    k = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"],
        values=torch.randint(0, 10, (n,), generator=gen),
        lengths=lengths,
        weights=torch.rand(n, generator=gen) if weighted else None,
    )
    jb = JaggedBatch.from_kjt(k, [16, 16, 16])
    whole = _per_sample(jb)
    parts = [jb.split_samples(3, i) for i in range(3)]
    for p in parts:
        assert p.batch_size == 2 and p.capacities == jb.capacities
        assert pytree.tree_flatten(p)[0][0].shape == jb.values().shape
        assert (p.weights_or_none() is not None) == weighted
        validate_batch(p, TABLES[:1] + [EmbeddingTable("t3", 10, 2, ("f3",))])
    split = [_per_sample(p) for p in parts]
    for key in whole:
        assert sum((s[key] for s in split), []) == whole[key], key
    # ids compacted to the front; padding repeats the part's first id of the feature (or 0 when empty)
    for p in parts:
        for key, real in zip(p.keys(), p.num_ids()):
            ids, _ = p.segment(key)
            assert ids[real:].tolist() == [ids[0].item() if real else 0] * (16 - real)


def test_split_samples_errors():
    jb = JaggedBatch.from_kjt(kjt([1, 2, 3, 4, 4, 0], [2, 0, 1, 2, 0, 1]), [4, 4, 2])  # B=2
    with pytest.raises(DataError, match="batch size 2 does not split into 3 equal parts"):
        jb.split_samples(3, 0)
    with pytest.raises(DataError, match="part 2 is outside 0..1"):
        jb.split_samples(2, 2)
    with pytest.raises(DataError, match="positive int"):
        jb.split_samples(0, 0)
    assert jb.split_samples(1, 0).values().tolist() == jb.values().tolist()
