"""Batch format, synthetic data, file loaders (real formats, written here), `prepare`, metrics and
checkpoint atomicity; every malformed input is a DataError naming the file and line."""

import math
import os

import numpy as np
import pytest
import torch
from recir.dlrmv3 import (
    PADDING_ID,
    ModelConfig,
    PaddingStats,
    Sample,
    auc,
    collate,
    dataset_spec,
    fit_token_budget,
    latest_checkpoint,
    load_checkpoint,
    make_data,
    normalized_entropy,
    prepare_kuairand,
    prepare_movielens,
    save_checkpoint,
)
from recir.dlrmv3._metrics import MetricAccumulator
from recir.transforms import ConfigError, DataError

CFG = ModelConfig(embedding_dim=8, num_layers=1, uih_len=4, num_candidates=3, hash_size=100)


def test_dlrmv3_collate_pads_truncates_and_hashes_to_static_shapes():
    spec = dataset_spec("debug")
    s = Sample(
        uih_ids=np.array([11, 12, 13, 14, 15, 16]),
        uih_timestamps=np.arange(6) + 100,
        uih_actions=np.array([1, 0, 1, 0, 1, 0]),
        cand_ids=np.array([7]),
        cand_actions=np.array([1]),
        contextual=np.array([0, 250]),
    )
    rows = {f: 100 for f in spec.features}
    b = collate([s, s], spec, uih_len=4, num_candidates=3, rows=rows)
    assert b.uih_lengths.tolist() == [4, 4] and b.num_candidates.tolist() == [1, 1]
    assert b.uih_timestamps[0].tolist() == [102, 103, 104, 105]  # the most recent events are kept
    values = b.features.values()
    assert values.shape == (2 * 4 + 2 * 3 + 2 * 2,)
    assert b.features.lengths().tolist() == [4, 4, 3, 3, 1, 1, 1, 1]
    assert b.features.length_per_key() == [8, 6, 2, 2]
    cand = values[8:14].view(2, 3)
    assert cand[0].tolist() == [7, PADDING_ID, PADDING_ID]
    ctx = values[14:]
    assert PADDING_ID not in ctx.tolist() and int(ctx.max()) < 100  # hashed into [1, rows)
    # the pytree round trip keeps every tensor and the KJT's static sizes
    flat, spec_ = torch.utils._pytree.tree_flatten(b)
    assert all(isinstance(t, torch.Tensor) for t in flat)
    again = torch.utils._pytree.tree_unflatten(flat, spec_)
    assert again.features.length_per_key() == [8, 6, 2, 2]


def _sample(uih: int, cand: int, t0: int = 100) -> Sample:
    return Sample(
        uih_ids=np.arange(uih) + 1,
        uih_timestamps=np.arange(uih) + t0,
        uih_actions=np.ones(uih, np.int64),
        cand_ids=np.arange(cand) + 1,
        cand_actions=np.ones(cand, np.int64),
        contextual=np.array([1, 2]),
    )


def test_dlrmv3_token_budget_packs_real_tokens_and_trims_the_oldest_events():
    spec = dataset_spec("debug")  # 2 contextual tokens; N = 2 + 6 + 3 = 11 slots per sample
    samples = [_sample(6, 3), _sample(2, 1), _sample(5, 2)]
    real = 3 * 2 + (6 + 2 + 5) + (3 + 1 + 2)  # 25 of 33 slots
    padded = collate(samples, spec, 6, 3)
    assert not padded.packed and padded.token_index.tolist() == list(range(33))
    exact = collate(samples, spec, 6, 3, token_budget=real)
    valid = [
        j < 2 or (2 <= j < 8 and j - 2 < u) or (j >= 8 and j - 8 < c)
        for u, c in ((6, 3), (2, 1), (5, 2))
        for j in range(11)
    ]
    assert exact.packed and exact.token_index.tolist() == [i for i, v in enumerate(valid) if v]
    assert exact.uih_lengths.tolist() == [6, 2, 5] and exact.max_seq_len[0] == 2 + 9
    # two rows more than the real tokens: the first two padded slots, the index sorted and distinct
    loose = collate(samples, spec, 6, 3, token_budget=real + 2)
    extra = sorted(set(loose.token_index.tolist()) - set(exact.token_index.tolist()))
    assert extra == [i for i, v in enumerate(valid) if not v][:2]
    # 4 tokens over: the longest histories lose their oldest events (6 -> 4, 5 -> 3), candidates stay
    trimmed = collate(samples, spec, 6, 3, token_budget=real - 4)
    assert trimmed.uih_lengths.tolist() == [4, 2, 3] and trimmed.num_candidates.tolist() == [3, 1, 2]
    assert trimmed.uih_timestamps[0].tolist() == [102, 103, 104, 105, 0, 0]  # the newest kept
    assert trimmed.token_index.shape == (real - 4,) and trimmed.max_seq_len[0] == 2 + 7
    kept, dropped = fit_token_budget(samples, 2, 6, 3, real - 5)  # an odd rest: one event more on one
    assert dropped == 5 and sorted(len(s.uih_ids) for s in kept) == [2, 3, 3]
    with pytest.raises(ValueError, match="below the batch's contextual tokens and candidates"):
        fit_token_budget(samples, 2, 6, 3, 10)
    stats = PaddingStats()
    stats.add(exact)
    assert (stats.real, stats.padded) == (19, 19) and stats.waste == 0.0


def test_dlrmv3_token_budget_flag_auto_and_data_parallel_slices():
    cfg = ModelConfig(embedding_dim=8, num_layers=1, uih_len=16, num_candidates=3, hash_size=100)
    data = make_data("debug", cfg, batch_size=8, seed=0, token_budget="auto")
    slots = 8 * (2 + 16 + 3)
    reals = [
        2 + min(s.uih_ids.size, 16) + min(s.cand_ids.size, 3) for s in (data.train[i] for i in range(4096))
    ]
    mean, sd = 8 * np.mean(reals), np.sqrt(8) * np.std(reals)
    assert data.token_budget == min(slots, int(np.ceil((mean + 2 * sd) / 8) * 8)) < slots
    assert data.train_batch(0).token_index.shape == (data.token_budget,)
    assert not next(data.eval_batches(1)).packed  # eval batches stay whole
    # two data-parallel slices: each trimmed to its half, the global norms from the trimmed batch
    data.token_budget = 8 * 5 + 20
    samples = [data.train[i] for i in data.train_indices(3)]
    halves = [data.collate_slice(samples, r, 2) for r in range(2)]
    assert all(h.token_index.shape == (30,) for h in halves)
    lengths = torch.cat([h.uih_lengths for h in halves])
    ncand = torch.cat([h.num_candidates for h in halves])
    assert int(halves[0].max_seq_len[0]) == int(halves[1].max_seq_len[0]) == 2 + int((lengths + ncand).max())
    with pytest.raises(ConfigError, match=r"--token_budget 30 is below .* \(8 x \(2 \+ 3\) = 40\)"):
        make_data("debug", cfg, batch_size=8, seed=0, token_budget=30)
    with pytest.raises(ConfigError, match="a number of tokens or 'auto', got 'many'"):
        make_data("debug", cfg, batch_size=8, seed=0, token_budget="many")


def test_dlrmv3_token_buckets_pack_each_batch_into_the_smallest_budget_that_holds_it():
    cfg = ModelConfig(embedding_dim=8, num_layers=1, uih_len=32, num_candidates=3, hash_size=100)
    data = make_data("debug", cfg, batch_size=8, seed=0, token_budget="auto", token_buckets=3)
    single = make_data("debug", cfg, batch_size=8, seed=0, token_budget="auto").token_budget
    buckets = data.token_buckets
    assert (
        2 <= len(buckets) <= 3 and list(buckets) == sorted(set(buckets)) and buckets[-1] == data.token_budget
    )
    assert all(b % 8 == 0 for b in buckets) and buckets[0] < single
    assert "budgets" in data.bucket_report and f"one budget of {single}" in data.bucket_report
    seen = set()
    for step in range(64):  # the window the buckets came from: none of its batches is trimmed
        samples = [data.train[i] for i in data.train_indices(step)]
        real = sum(2 + min(s.uih_ids.size, 32) + min(s.cand_ids.size, 3) for s in samples)
        rows = int(data.train_batch(step).token_index.shape[0])
        assert rows == min(b for b in buckets if b >= real), (step, real, rows)
        seen.add(rows)
        if step == 5:  # data-parallel slices pack into one bucket's share
            halves = [data.collate_slice(samples, r, 2) for r in range(2)]
            assert all(int(h.token_index.shape[0]) == -(-rows // 2) for h in halves)
    assert seen == set(buckets)  # every budget is used
    examples = data.bucket_examples(7)
    assert [int(e.token_index.shape[0]) for e in examples] == list(buckets)
    with pytest.raises(ConfigError, match="it takes --token_budget auto .*got --token_budget 200"):
        make_data("debug", cfg, batch_size=8, seed=0, token_budget=200, token_buckets=2)


def test_dlrmv3_synthetic_data_is_deterministic_and_skewed():
    a = make_data("debug", CFG, batch_size=8, seed=3)
    b = make_data("debug", CFG, batch_size=8, seed=3)
    c = make_data("debug", CFG, batch_size=8, seed=4)
    assert torch.equal(a.train_batch(5).features.values(), b.train_batch(5).features.values())
    assert not torch.equal(a.train_batch(5).features.values(), c.train_batch(5).features.values())
    ids = np.concatenate([a.train[i].uih_ids for i in range(300)])
    counts = np.bincount(ids)
    assert counts.max() > 10 * max(np.median(counts[counts > 0]), 1)  # popularity skew
    rnd = make_data("debug-random", CFG, batch_size=8, seed=3)
    s = rnd.train[0]
    assert s.uih_ids.min() >= 1 and s.uih_ids.max() < 1000


def _write(path, text):  # type: ignore[no-untyped-def]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _movielens_rows(n_users: int, n_events: int) -> str:
    lines = [
        "index,user_id,sequence_item_ids,sequence_ratings,sequence_timestamps,sex,age_group,occupation,zip_code"
    ]
    for u in range(n_users):
        ids = ",".join(str(1 + (u * 7 + i) % 50) for i in range(n_events))
        ratings = ",".join(str(1 + (u + i) % 5) for i in range(n_events))
        ts = ",".join(str(978300000 + 60 * i) for i in range(n_events))
        lines.append(f'{u},{u + 1},"{ids}","{ratings}","{ts}",{u % 2},{u % 7},{u % 21},{u}')
    return "\n".join(lines) + "\n"


def test_dlrmv3_movielens_loader_reads_the_sasrec_format(tmp_path):
    _write(tmp_path / "sasrec_format.csv", _movielens_rows(8, 14) + '8,9,"1,2","4,5","1,2",0,0,0,0\n')
    data = make_data("movielens-1m", CFG, batch_size=2, seed=0, data_dir=tmp_path)
    assert len(data.train) + len(data.eval) == 8  # the 2-event user is skipped
    assert len(data.train) == 6
    s = data.train[0]
    assert len(s.uih_ids) == 4 and len(s.cand_ids) == 10  # the last 10 events are candidates
    # rating r sets action bit r-1; the task is rating >= 3.5 (bits 8|16)
    assert set(np.unique(s.cand_actions)) <= {1, 2, 4, 8, 16}
    batch = data.train_batch(0)
    labels, _ = __import__("recir.dlrmv3", fromlist=["x"]).DLRMv3(data.spec, CFG).labels(batch)
    assert labels.shape == (2, 3, 1)


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("index,user_id\n", r"sasrec_format.csv:1: header is missing column\(s\) sequence_item_ids"),
        (
            'index,user_id,sequence_item_ids,sequence_ratings,sequence_timestamps\n0,1,"1,x","5,5","1,2"\n',
            r"sasrec_format.csv:2: column 'sequence_item_ids': expected a comma-separated list",
        ),
        (
            'index,user_id,sequence_item_ids,sequence_ratings,sequence_timestamps\n0,1,"1,2","5","1,2"\n',
            r"sasrec_format.csv:2: the per-event lists must have equal lengths",
        ),
        (
            'index,user_id,sequence_item_ids,sequence_ratings,sequence_timestamps\n0,1,"1,2","9,5","1,2"\n',
            r"sasrec_format.csv:2: column 'sequence_ratings': expected ratings 1..5",
        ),
    ],
)
def test_dlrmv3_malformed_movielens_file_names_file_and_line(tmp_path, text, expect):
    _write(tmp_path / "sasrec_format.csv", text)
    with pytest.raises(DataError, match=expect):
        make_data("movielens-20m", CFG, batch_size=2, seed=0, data_dir=tmp_path)


def test_dlrmv3_missing_files_and_bad_config_are_clear_errors(tmp_path):
    with pytest.raises(
        DataError, match=r"no sasrec_format.csv found; tried .*ml-1m/sasrec_format.csv.*prepare"
    ):
        make_data("movielens-1m", CFG, batch_size=2, seed=0, data_dir=tmp_path)
    with pytest.raises(DataError, match="--data_dir"):
        make_data("kuairand-1k", CFG, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="--batch_size must be >= 1, got -1"):
        make_data("debug", CFG, batch_size=-1, seed=0)
    with pytest.raises(ConfigError, match="unknown dataset 'criteo'"):
        make_data("criteo", CFG, batch_size=2, seed=0)
    with pytest.raises(ConfigError, match="divisible by --num_heads"):
        ModelConfig(embedding_dim=10, num_heads=3)


def test_dlrmv3_prepare_movielens_1m_and_100k(tmp_path):
    raw = tmp_path / "raw"
    lines = [f"{u}::{m}::{1 + (u + m) % 5}::{978300000 + 37 * m}" for u in (1, 2, 3) for m in range(1, 16)]
    _write(raw / "ratings.dat", "\n".join(lines) + "\n")
    _write(raw / "users.dat", "1::F::1::10::48067\n2::M::56::16::70072\n3::M::25::15::55117\n")
    out = prepare_movielens(raw, tmp_path / "ml-1m")
    assert out.name == "sasrec_format.csv"
    data = make_data("movielens-1m", CFG, batch_size=1, seed=0, data_dir=tmp_path)
    assert len(data.train) + len(data.eval) == 3
    assert data.train[0].contextual.tolist() == [1, 0, 0, 0, 0]  # user 1: first codes of each column
    raw100 = tmp_path / "raw100"
    _write(
        raw100 / "u.data",
        "\n".join(f"{u}\t{m}\t4\t{880000000 + m}" for u in (5, 6) for m in range(12)) + "\n",
    )
    prepare_movielens(raw100, tmp_path / "ml100k")
    data = make_data("movielens-20m", CFG, batch_size=1, seed=0, data_dir=tmp_path / "ml100k")
    assert len(data.train) + len(data.eval) == 2
    _write(raw100 / "u.data", "5\t1\tfour\t880000000\n")
    with pytest.raises(DataError, match=r"u.data:1: expected numbers"):
        prepare_movielens(raw100, tmp_path / "bad")


def test_dlrmv3_prepare_kuairand_and_load(tmp_path):
    raw = tmp_path / "raw"
    head = "user_id,video_id,date,hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,long_view,play_time_ms,duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab"
    rows = [
        f"{u},{100 + i},20220408,1000,{1649376000000 + 1000 * i},{i % 2},{i % 3 == 0:d},0,0,0,0,1,5000,9000,0,0,{i % 5 == 0:d},0,1"
        for u in (0, 1, 2)
        for i in range(13)
    ]
    _write(raw / "log_standard_4_08_to_4_21_1k.csv", head + "\n" + "\n".join(rows) + "\n")
    feats = "user_id,user_active_degree,follow_user_num_range,fans_user_num_range,friend_user_num_range,register_days_range\n"
    feats += "0,high_active,0,1-10,0,61-90\n1,full_active,1-10,0,5-30,730+\n2,high_active,0,0,0,61-90\n"
    _write(raw / "user_features_1k.csv", feats)
    prepare_kuairand(raw, tmp_path / "KuaiRand-1K" / "data")
    data = make_data("kuairand-1k", CFG, batch_size=1, seed=0, data_dir=tmp_path)
    s = data.train[0]
    assert len(s.uih_ids) == 3 and len(s.cand_ids) == 10
    assert s.uih_actions[0] == 2 | 64 | 128  # event 0: like, long_view, profile_enter (no click)
    assert s.uih_actions[1] == 1 | 64  # event 1: click, long_view
    assert s.contextual.tolist()[1:] == [0, 0, 0, 0, 0]
    with pytest.raises(DataError, match=r"no KuaiRand log files"):
        prepare_kuairand(tmp_path / "nothing", tmp_path / "out")


def test_dlrmv3_metrics_against_brute_force():
    rng = np.random.default_rng(0)
    scores = torch.tensor(rng.integers(0, 5, 40), dtype=torch.float32)  # many ties
    labels = torch.tensor(rng.integers(0, 2, 40), dtype=torch.float32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    brute = ((pos[:, None] > neg[None, :]).float() + 0.5 * (pos[:, None] == neg[None, :]).float()).mean()
    assert math.isclose(auc(scores, labels), float(brute), rel_tol=1e-6)
    p = float(labels.mean())
    base = torch.full((40,), math.log(p / (1 - p)))
    assert math.isclose(normalized_entropy(base, labels), 1.0, rel_tol=1e-6)
    acc = MetricAccumulator(("t",))
    logits = torch.tensor([[[2.0], [-1.0], [0.5]], [[1.0], [3.0], [9.0]]])
    lab = torch.tensor([[[1.0], [0.0], [1.0]], [[1.0], [0.0], [0.0]]])
    acc.update(logits, lab, torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
    m = acc.compute()
    assert m["t/auc"] == pytest.approx(2 / 6)  # positives (2, 1) beat only the negative -1 of (-1, 3, 9)
    assert m["t/gauc"] == pytest.approx((1.0 * 2 + 0.0 * 3) / 5)  # per user, weighted by candidates
    assert m["t/accuracy"] == pytest.approx(3 / 5)


def _per_user_loop_gauc(logits, labels, users):
    # the hand-written per-user loop the metrics used before torchmetrics (O(users x n)): the reference
    total, weight = 0.0, 0.0
    for u in torch.unique(users):
        sel = users == u
        lab = labels[sel]
        if 0 < float(lab.sum()) < lab.numel():
            pos, neg = logits[sel][lab == 1], logits[sel][lab == 0]
            a = (
                (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
            ).mean()
            total, weight = total + float(a) * lab.numel(), weight + lab.numel()
    return total / weight if weight else float("nan")


@pytest.mark.parametrize("seed", range(5))
def test_dlrmv3_gauc_and_auc_agree_with_the_per_user_loop(seed):
    # many users of varied sizes, coarse scores (ties inside and across users), users with one label only
    gen = torch.Generator().manual_seed(seed)
    n = 600
    users = torch.randint(0, 80, (n,), generator=gen)
    logits = torch.randint(-4, 5, (n,), generator=gen).float() * 0.5 + (seed == 0) * 60.0  # 60: saturating
    labels = (torch.rand(n, generator=gen) < 0.3).float()
    labels[users == 3] = 1.0  # a user with positives only: left out of GAUC
    from recir.dlrmv3._metrics import _gauc

    assert _gauc(logits, labels, users) == pytest.approx(
        _per_user_loop_gauc(logits, labels, users), rel=1e-12
    )
    pos, neg = logits[labels == 1], logits[labels == 0]
    brute = ((pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()).mean()
    assert auc(logits, labels) == pytest.approx(float(brute), rel=1e-6)  # torchmetrics: float32
    assert math.isnan(_gauc(logits, torch.ones(n), users)) and math.isnan(auc(logits, torch.zeros(n)))


def test_dlrmv3_checkpoint_survives_a_crash_mid_write(tmp_path):
    state = {
        "param:w": torch.arange(6.0).view(2, 3),
        "optim:step": torch.tensor(3.0),
        "rng:x": torch.get_rng_state(),
    }
    save_checkpoint(tmp_path, 4, state, {"dataset": "debug"})
    # a crash while writing step 8: the temp dir exists, 'latest' still names step 4
    (tmp_path / ".tmp-step-8").mkdir()
    (tmp_path / ".tmp-step-8" / "__0_0.distcp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"
    loaded, meta = load_checkpoint(tmp_path)
    assert meta["step"] == 4 and torch.equal(loaded["param:w"], state["param:w"])
    assert torch.equal(loaded["rng:x"], state["rng:x"])
    for step in (8, 12, 16):
        save_checkpoint(tmp_path, step, state, {})
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-12", "step-16"]
    os.remove(tmp_path / "latest")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-16"
    with pytest.raises(DataError, match="no complete checkpoint"):
        load_checkpoint(tmp_path / "empty")
