"""Cached-history serving: a user's history encoded once, candidates scored against the cache, equal to
the trained model scoring the full sequence (eager and through both stacks' exported artifacts)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.utils._pytree as pytree
from recir.capture import capture_train_step, load_into
from recir.dlrmv3 import (
    CandidateScorer,
    HistoryEncoder,
    MetricAccumulator,
    SyntheticDataset,
    TrainOptions,
    cached_history_graphs,
    collate,
    load_cached_history,
    serving_max_len,
    split_batch,
    train,
)
from recir.dlrmv3._checkpoint import load_checkpoint
from recir.dlrmv3._export import _options, export_model, predict
from recir.dlrmv3._model import loss_fn
from recir.dlrmv3._train import build
from recir.embedding import overrides
from recir.transforms import ConfigError, DataError, cached_history, to_inference

TINY = dict(batch_size=4, embedding_dim=16, num_layers=2, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1)  # fmt: skip
COUNTS = (1, 5, 64)
TOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt")
    opts = TrainOptions(**TINY, target="eager", num_train_batches=6, log_every=100, checkpoint_dir=str(ckpt),
                        checkpoint_every=6)  # fmt: skip
    train(opts, log=lambda _line: None)
    state, meta = load_checkpoint(str(ckpt))
    model, data, optimizers = build(_options(meta["options"]))
    load_into(model, (), state)
    model.eval()
    return ckpt, model, data, optimizers


def _requests(model, data, count, reverse=False):
    """The same 4 eval users (2 with a padded history) with (up to) `count` of their candidates each
    (`reverse`: the last `count` of them, in reverse order), as a full-sequence batch whose attention
    normaliser is pinned to the serving value, and as (history inputs, candidate ids)."""
    L = model.config.uih_len
    ds = SyntheticDataset(data.spec, seed=0, split="eval", uih_len=L, num_candidates=max(COUNTS),
                          num_items=model.config.hash_size)  # fmt: skip
    short = [s for s in (ds[i] for i in range(64)) if len(s.uih_ids) < L][:2]
    full = [s for s in (ds[i] for i in range(64)) if len(s.uih_ids) >= L][:2]
    samples = short + full
    if reverse:
        samples = [dataclasses.replace(s, cand_ids=s.cand_ids[::-1].copy(), cand_actions=s.cand_actions[::-1].copy())
                   for s in samples]  # fmt: skip
    batch = collate(samples, data.spec, L, count, data.rows)
    history, cand_ids = split_batch(model, batch, serving_max_len(model))
    batch.max_seq_len = history.max_seq_len
    real = torch.arange(count)[None, :] < batch.num_candidates[:, None]
    return batch, history, cand_ids, real


def _max_delta(full, got, real):
    return (full - got)[real].abs().max().item()


def test_candidates_against_one_cached_history_equal_full_sequence_scores(trained):
    _, model, data, _ = trained
    encode, score = HistoryEncoder(model), CandidateScorer(model)
    _, history, _, _ = _requests(model, data, COUNTS[0])
    with torch.no_grad():
        cache = encode(*history.tensors())  # once per user
        for count in COUNTS:
            batch, same_users, cand_ids, real = _requests(model, data, count)
            for a, b in zip(history.tensors(), same_users.tensors()):
                assert torch.equal(a, b)  # the users' histories do not change with the candidate count
            full = model(batch)
            got = score(*cache, cand_ids)
            assert got.shape == full.shape
            assert _max_delta(full, got, real) <= TOL, count
    keys, values, _, _ = cache
    L = model.config.uih_len + len(data.spec.contextual)
    assert (
        keys.shape
        == values.shape
        == (model.config.num_layers, 4, model.config.num_heads, L, model.config.head_dim)
    )


def _products(graph):
    mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return [n.meta["val"].shape[0] for n in graph.graph.nodes if n.target in mm]


def test_cached_history_graphs_split_the_serving_graph_into_history_and_candidate_work(trained):
    # recir.transforms.cached_history on the captured step's serving graph: the history graph's cache,
    # computed once, scores any candidate set of the same users through the candidate graph (reference
    # interpreter) as the trained model scores the full sequence
    _, model, data, optimizers = trained
    B, P = 4, len(data.spec.contextual) + model.config.uih_len
    batches = {count: _requests(model, data, count) for count in COUNTS}
    graphs = {count: cached_history_graphs(model, optimizers, batches[count][0]) for count in COUNTS}
    assert model.candidates_only_last_layer and not any(layer.recompute_scores for layer in model.layers)
    first = graphs[COUNTS[0]]
    assert first.cache == tuple(f"cache.{i}.{kind}" for i in range(2) for kind in ("keys", "values"))

    def state(graph):
        return graph.init_state(model, optimizers)

    with torch.no_grad():
        _, cache = first.history(state(first.history), batches[COUNTS[0]][0])
        for count in COUNTS:
            batch, _, _, real = batches[count]
            split = graphs[count]
            _, again = split.history(state(split.history), batch)
            for a, b in zip(cache, again):  # the history's cache does not depend on the candidates
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            _, (got,) = split.candidates(state(split.candidates), (batch, tuple(cache)))
            assert _max_delta(model(batch), got, real) <= TOL, count
            # the candidate graph computes the candidates' rows only: every product on B x count rows, no
            # attention among history tokens; the history graph none on the candidates' rows
            assert set(_products(split.candidates)) == {B * count}, count
            assert torch.ops.recir.hstu_attention.default not in {
                n.target for n in split.candidates.graph.nodes
            }
            assert B * count not in _products(split.history)
            assert B * P in _products(split.history)
    for a in cache:
        assert tuple(a.shape) == (B, model.config.num_heads, P, model.config.head_dim)


@pytest.mark.parametrize("target", ["tpu", "gpu"], ids=["jax-export", "aot-inductor"])
def test_exported_history_and_candidate_artifacts_equal_full_sequence_scores(trained, target, tmp_path):
    ckpt, model, data, _ = trained
    out = tmp_path / f"serve.{target}"
    manifest = export_model(str(ckpt), target, str(out), log=lambda _line: None, serving="cached-history",
                            candidates=64)  # fmt: skip
    assert json.loads((tmp_path / f"serve.{target}.json").read_text())["entries"] == manifest["entries"]
    assert manifest["dlrmv3"]["step"] == 6 and manifest["max_seq_len"] == serving_max_len(model)
    assert (manifest["users"], manifest["candidates"]) == (4, 64)
    history_fn, candidates_fn = load_cached_history(out)
    batch, _, _, real = _requests(model, data, 64)
    leaves = pytree.tree_leaves(batch)
    cache = history_fn(*leaves)  # once per user
    with torch.no_grad():
        full = model(batch)
    assert _max_delta(full, candidates_fn(*leaves, *cache), real) <= TOL
    # another request of the same users (other candidates, other order) against the same cache
    batch, _, _, real = _requests(model, data, 64, reverse=True)
    with torch.no_grad():
        full = model(batch)
    assert _max_delta(full, candidates_fn(*pytree.tree_leaves(batch), *cache), real) <= TOL


#: bf16 cached-history artifacts against eager fp32 full-sequence scoring, 4 users x 64 candidates:
#: max |logit delta| 2.2e-3 (jax.export) and 2.4e-3 (AOTInductor), from the split serving graphs (2026-12-05;
#: 1.7e-3 / 2.3e-3 from the earlier hand-written modules); the bound is about 4x that. Above 1e-4: the products did run in
#: bf16 (fp32 artifacts stay within 1e-5).
BF16_LOGIT_BOUND = 1e-2


def _artifacts_delta(out, model, data) -> float:
    """Max |logit delta| of the cached-history artifacts at ``out`` (history, then candidates) against the
    model scoring the same 64-candidate requests' full sequences."""
    history_fn, candidates_fn = load_cached_history(out)
    batch, _, _, real = _requests(model, data, 64)
    leaves = pytree.tree_leaves(batch)
    with torch.no_grad():
        full = model(batch)
    return _max_delta(full, candidates_fn(*leaves, *history_fn(*leaves)), real)


@pytest.mark.parametrize("target", ["tpu", "gpu"], ids=["jax-export", "aot-inductor"])
def test_bf16_cached_history_artifacts_run_their_products_in_bf16(trained, target, tmp_path):
    ckpt, model, data, _ = trained
    out = tmp_path / f"serve.{target}"
    manifest = export_model(str(ckpt), target, str(out), log=lambda _line: None, serving="cached-history",
                            candidates=64, precision="bf16")  # fmt: skip
    assert manifest["precision"] == "bf16"
    delta = _artifacts_delta(out, model, data)
    print(f"bf16 cached history {target}: max |logit delta| {delta:.2e}")
    assert 1e-4 < delta <= BF16_LOGIT_BOUND


def test_bad_requests_are_config_errors(trained, tmp_path):
    ckpt, model, _, optimizers = trained
    model.train()
    try:
        with pytest.raises(ConfigError, match="training mode"):
            HistoryEncoder(model)
    finally:
        model.eval()
    with pytest.raises(ConfigError, match="no recir::hstu_attention with candidate slots"):
        # the default model: the last layer's candidates-only attention is not the op
        step = capture_train_step(
            model, optimizers, loss_fn, trained[2].train_batch(0), overrides=overrides()
        )
        cached_history(to_inference(step))
    with pytest.raises(ConfigError, match="--candidates must be at least 1"):
        export_model(str(ckpt), "tpu", str(tmp_path / "x"), log=lambda _line: None, serving="cached-history",
                     candidates=0)  # fmt: skip
    with pytest.raises(ConfigError, match="--serving must be"):
        export_model(str(ckpt), "tpu", str(tmp_path / "x"), log=lambda _line: None, serving="cached")


def test_export_cli_refuses_a_bad_candidate_count(trained, tmp_path, capsys):
    from recir.dlrmv3._cli import main

    ckpt, _, _, _ = trained
    argv = ["export", "--checkpoint", str(ckpt), "--target", "tpu", "--out", str(tmp_path / "x"),
            "--serving", "cached-history", "--candidates", "0"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--candidates must be at least 1" in err and "Fix:" in err


def test_predict_runs_the_cached_history_artifacts(trained, tmp_path):
    ckpt, model, data, _ = trained
    out = tmp_path / "serve.tpu"
    export_model(str(ckpt), "tpu", str(out), log=lambda _line: None, serving="cached-history")
    got = predict(str(out), num_batches=2, log=lambda _line: None)
    acc = MetricAccumulator(tuple(t.name for t in data.spec.tasks))
    with torch.no_grad():
        for batch in data.eval_batches(2):  # eager, full sequences, the normaliser pinned as served
            batch.max_seq_len = torch.full_like(batch.max_seq_len, serving_max_len(model))
            labels, weights = model.labels(batch)
            acc.update(model(batch), labels, weights)
    want = acc.compute()
    assert got.keys() == want.keys() | {"predict/p50_ms", "predict/p99_ms", "predict/samples_per_s"}
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    other = tmp_path / "five.tpu"
    export_model(str(ckpt), "tpu", str(other), log=lambda _line: None, serving="cached-history", candidates=5)
    with pytest.raises(DataError, match=r"4 users x 5 candidates .* Fix: export .* --candidates 3"):
        predict(str(other), num_batches=1, log=lambda _line: None)


#: int8 tables (recir-embed-quantize-tables on both graphs) against eager fp32, 4 users x 64 candidates:
#: max |logit delta| 1.1e-4 (jax.export, 2026-12-05); the bound is the full-sequence export's int8 bound.
INT8_LOGIT_BOUND = 3e-4


def test_int8_cached_history_artifacts_read_quantised_tables(trained, tmp_path):
    ckpt, model, data, _ = trained
    out = tmp_path / "serve.tpu"
    manifest = export_model(str(ckpt), "tpu", str(out), log=lambda _line: None, serving="cached-history",
                            candidates=64, quantize="int8")  # fmt: skip
    assert manifest["quantize"] == "int8"
    for name in ("history", "candidates"):  # each graph looks its ids up in the uint8 rows
        entry = json.loads((tmp_path / manifest["entries"][name]["manifest"]).read_text())
        assert "uint8" in {s["dtype"] for s in entry["baked_state"]}, name
    delta = _artifacts_delta(out, model, data)
    print(f"int8 cached history: max |logit delta| {delta:.2e}")
    assert 0 < delta <= INT8_LOGIT_BOUND
