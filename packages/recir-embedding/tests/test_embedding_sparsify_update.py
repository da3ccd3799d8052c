"""recir-embed-sparsify-update: graph before/after, numerics against the dense step, negative cases,
and a deliberately broken rewrite the verifier catches."""

from __future__ import annotations

import copy

import pytest
import torch
from recir.embedding import ConfigError, SparsifyUpdate, dedupe, overrides
from recir.embedding._testing import build_step
from recir.transforms import PHASE_KEY, Pipeline, VerificationError, apply_overrides, get_transform

aten = torch.ops.aten


def _step(helpers, kind, hparams=None):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    batch, _ = helpers.random_batch(torch.Generator().manual_seed(2))
    return model, batch, build_step(model, helpers.loss_fn, batch, kind, hparams)


def _copy(step):
    import torch.fx as fx

    g = fx.Graph()
    g.output(g.graph_copy(step.graph, {}))
    return step.replace(graph_module=fx.GraphModule(step.graph_module, g))


TABLE_SHAPES = {(20, 4), (12, 3), (15, 4)}


def _table_sized_optimizer_nodes(step):
    """Optimizer-phase nodes whose value has a table's shape (what makes a step cost O(rows))."""
    out = []
    for n in step.graph.nodes:
        val = n.meta.get("val")
        is_tensor = isinstance(val, torch.Tensor)
        if n.meta.get(PHASE_KEY) == "optimizer" and is_tensor and tuple(val.shape) in TABLE_SHAPES:
            out.append(n.target)
    return out


def test_registered_and_rewrites_the_graph(helpers):
    assert get_transform("recir-embed-sparsify-update") is SparsifyUpdate
    model, batch, step = _step(helpers, "adagrad")
    before = _table_sized_optimizer_nodes(step)
    assert aten.sqrt.default in before and aten.mul.Tensor in before  # dense Adagrad over whole tables
    dense = _copy(step)
    after = Pipeline([SparsifyUpdate()]).run(step)
    # after: the only table-sized optimizer nodes are the row write-backs (weight and accumulator per table)
    assert _table_sized_optimizer_nodes(after) == [aten.index_put.default] * 6
    dense_grads = [
        n
        for n in after.graph.nodes
        if n.target == aten.index_add.default
        and n.meta[PHASE_KEY] == "backward"
        and tuple(n.meta["val"].shape) in TABLE_SHAPES
    ]
    assert not dense_grads, "the dense [rows, D] gradients are gone"
    sorts = [n for n in after.graph.nodes if n.target == aten.sort.default]
    assert [tuple(n.meta["val"][0].shape) for n in sorts] == [(32,), (16,), (16,)]  # N = ids per table
    state = dense.init_state(model)
    want, want_out = dense(state, batch)
    got, got_out = after(state, batch)
    torch.testing.assert_close(got_out, want_out)
    for name, a, b in zip(dense.signature.state_names(), want, got):
        torch.testing.assert_close(b, a, msg=name)


def test_lazy_adam_leaves_untouched_rows_alone(helpers):
    model, batch, step = _step(helpers, "adam")
    dense = _copy(step)
    res = SparsifyUpdate()(step)
    assert res.changed and len(res.stats["sparsified"]) == 3
    state = dense.init_state(model)
    for _ in range(2):  # nonzero moments first, then a batch touching other rows
        state, _ = res.step(state, batch)
    names = dense.signature.state_names()
    w = names.index("param:ebc.embedding_bags.t2.weight")
    jb = batch["features"]
    touched = set(jb.segment("f3")[0].tolist())
    untouched = [r for r in range(12) if r not in touched]
    start = model.ebc.embedding_bags["t2"].weight.detach()
    torch.testing.assert_close(state[w][untouched], start[untouched])  # lazy: unchanged
    dense_state, _ = dense(dense.init_state(model), batch)
    dense_state, _ = dense(dense_state, batch)
    torch.testing.assert_close(dense_state[w][untouched], start[untouched])  # zero moments there too
    torch.testing.assert_close(state[w], dense_state[w])


def test_dedupe_static_slots():
    ids = torch.tensor([5, 2, 5, 9, 2])
    g = torch.arange(10.0).view(5, 2)
    rows, summed, valid = dedupe(ids, g)
    assert rows.tolist()[:3] == [2, 5, 9]  # 3 unique rows in 5 static slots
    assert valid.tolist() == [True, True, True, False, False]
    assert not summed[3:].any()
    torch.testing.assert_close(summed[:3], torch.tensor([[10.0, 12.0], [4.0, 6.0], [6.0, 7.0]]))


def test_negative_cases(helpers):
    model, batch, step = _step(helpers, "sgd", {"momentum": 0.9})
    res = SparsifyUpdate()(step)
    assert not res.changed
    assert all("momentum" in r for r in res.stats["skipped"].values())
    no_meta = step.replace(meta={})
    with pytest.raises(ConfigError, match="no meta\\['recir.optimizer'\\]"):
        SparsifyUpdate()(no_meta)
    _, _, small = _step(helpers, "sgd")
    res = SparsifyUpdate(min_rows=16)(small)
    assert res.stats["sparsified"] == ["param:ebc.embedding_bags.t1.weight"]
    _, _, adam = _step(helpers, "adam")
    assert not SparsifyUpdate(lazy_adam=False)(adam).changed


class _BrokenSparsify(SparsifyUpdate):
    """Writes the new table back as float64: the verifier must catch the dtype change (INV-4)."""

    name = "recir-embed-broken-sparsify"

    def run(self, step):
        res = super().run(step)
        out = next(n for n in step.graph.nodes if n.op == "output")
        first = out.args[0][0]
        with step.graph.inserting_before(out):
            bad = step.graph.call_function(aten._to_copy.default, (first,), {"dtype": torch.float64})
        bad.meta.update(val=first.meta["val"].to(torch.float64), **{PHASE_KEY: "optimizer"})
        out.args = ((bad, *out.args[0][1:]),)
        step.graph_module.recompile()
        return res


def test_verifier_catches_a_broken_rewrite(helpers):
    _, _, step = _step(helpers, "sgd")
    with pytest.raises(VerificationError, match="INV-4") as exc:
        Pipeline([_BrokenSparsify()], verify_level=2).run(step)
    assert exc.value.transform == "recir-embed-broken-sparsify"


def test_padding_does_no_work_that_reaches_the_state(helpers):
    """A batch padded to 32 slots per feature and the same batch padded to its exact sizes give the same
    new state, and the sparse update writes exactly the rows of the real ids: padding repeats a real
    id of its feature and has no gradient, so it adds no row to the update."""
    from recir.capture import capture_train_step
    from recir.embedding import pad_to_bucket, tables_from_torchrec

    gen = torch.Generator().manual_seed(11)
    kjt = helpers.random_kjt(gen)
    batch = {"features": kjt, "y": torch.randn(helpers.B, generator=gen)}
    counts = dict(zip(kjt.keys(), kjt.lengths().view(len(kjt.keys()), -1).sum(1).tolist()))
    new_states = []
    for buckets in ([32], {k: [max(n, 1)] for k, n in counts.items()}):
        model = helpers.make_torchrec_model()
        # lazy Adam moves every row it updates, zero gradient or not: a padding row would show
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        step = capture_train_step(
            model, opt, helpers.loss_fn, batch, overrides=overrides(), batch_buckets=buckets
        )
        res = SparsifyUpdate()(step)
        assert len(res.stats["sparsified"]) == 3  # every table updates its rows only
        sparse = res.step
        state = sparse.init_state(model, opt)
        new, _ = sparse(state, batch)
        new_states.append(dict(zip(sparse.signature.state_names(), new)))
        before = dict(zip(sparse.signature.state_names(), state))
    padded, exact = new_states
    assert padded.keys() == exact.keys()
    for name in padded:
        torch.testing.assert_close(padded[name], exact[name], rtol=0, atol=1e-7, msg=name)
    ids = {k: set(jt.values().tolist()) for k, jt in kjt.to_dict().items()}
    jb, _ = pad_to_bucket(kjt, [32])
    for k, start, cap in zip(jb.keys(), jb.starts(), jb.capacities):
        assert set(jb.values()[start : start + cap].tolist()) == (ids[k] or {0}), k  # no id of its own
    collections = [m for m in helpers.make_torchrec_model().children() if hasattr(m, "embedding_bag_configs")
                   or hasattr(m, "embedding_configs")]  # fmt: skip
    for table in [t for m in collections for t in tables_from_torchrec(m)]:
        slot = next(n for n in padded if n.startswith("param:") and n.endswith(f".{table.name}.weight"))
        changed = (padded[slot] != before[slot]).any(1).nonzero().flatten().tolist()
        real = set().union(*(ids[f] for f in table.features))
        assert set(changed) <= real and len(changed) == len(real), (table.name, changed, real)


@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adam"])
def test_padding_touches_no_extra_row_and_changes_no_number(helpers, kind):
    """Padding as the batch boundary writes it (the padding item of the region-transforms issue: "prove
    it in a test"): each feature's slot is filled with a repeat of its first real id, a row the batch
    touches anyway, and belongs to no sample. So each step's sparse update writes exactly its real ids'
    rows (lazy Adam would move any other row it touched: the second step has moments from the first),
    and the same ids padded to twice the capacity give the same state, every slot."""
    from recir.embedding import pad_to_bucket

    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    gen = torch.Generator().manual_seed(4)
    first, second = helpers.random_kjt(gen), helpers.random_kjt(gen)
    # the second batch never has id 0 (the first does): a padding of 0 would be a touched extra row
    kjts = [first, type(second)(keys=second.keys(), values=second.values() + 1, lengths=second.lengths())]
    assert all(0 in first[f].values() and 0 not in kjts[1][f].values() for f in ("f2", "f3"))
    ys = [torch.randn(helpers.B, generator=gen) for _ in range(2)]
    per_table = {"t1": ("f1", "f2"), "t2": ("f3",), "s1": ("q",)}
    finals = []
    for bucket in (16, 32):
        step = None
        for kjt, y in zip(kjts, ys):
            jb, report = pad_to_bucket(kjt, [bucket])
            assert report.padded > 0
            batch = {"features": jb, "y": y}
            if step is None:
                step = SparsifyUpdate()(build_step(model, helpers.loss_fn, batch, kind)).step
                state = step.init_state(model)
                names = step.signature.state_names()
            old = [t.clone() for t in state]
            state, _ = step(state, batch)
            for table, features in per_table.items():
                k = next(
                    i
                    for i, n in enumerate(names)
                    if n.startswith("param:") and n.endswith(f".{table}.weight")
                )
                real = {int(i) for f in features for i in kjt[f].values()}
                written = {r for r in range(old[k].shape[0]) if not torch.equal(state[k][r], old[k][r])}
                assert written == real, (bucket, table, sorted(written), sorted(real))
        finals.append(dict(zip(names, state)))
    for name, value in finals[0].items():
        torch.testing.assert_close(finals[1][name], value, rtol=1e-6, atol=1e-7, msg=name)
