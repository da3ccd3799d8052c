"""Overrides: stand-ins for TorchRec EBC/EC and FBGEMM's dense TBE share parameters and match them."""

from __future__ import annotations

import copy

import pytest
import torch
from recir.embedding import CaptureError, DenseTBEOverride, JaggedBatch, overrides, pad_to_bucket
from recir.embedding._testing import build_step
from recir.transforms import OVERRIDE_KEY, apply_overrides


def _grads(model, loss_fn, batch):
    model.zero_grad()
    loss_fn(model, batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.smoke
def test_stand_ins_match_eager_torchrec_forward_and_gradients(helpers):
    tr = helpers.make_torchrec_model()
    model, applied = apply_overrides(copy.deepcopy(tr), overrides())
    assert [p for p, _ in applied] == ["ebc", "ec"]
    gen = torch.Generator().manual_seed(3)
    batch, kjt = helpers.random_batch(gen)
    pooled, seq = tr(kjt)
    pooled2, seq2 = model(batch["features"])  # padded JaggedBatch
    torch.testing.assert_close(pooled2, pooled)
    n = seq.shape[0]
    torch.testing.assert_close(seq2[:n], seq)
    assert not seq2[n:].any(), "padding rows are zero"
    pooled3, _ = model(kjt)  # eager KJT works too
    torch.testing.assert_close(pooled3, pooled)
    want = _grads(tr, helpers.loss_fn, {"features": kjt, "y": batch["y"]})
    got = _grads(model, helpers.loss_fn, batch)
    assert sorted(want) == sorted(got)  # same parameter names
    for name in want:
        torch.testing.assert_close(got[name], want[name])


def test_captured_step_uses_user_names_and_recir_ops(helpers):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    batch, _ = helpers.random_batch(torch.Generator().manual_seed(0))
    step = build_step(model, helpers.loss_fn, batch, "sgd")
    names = step.signature.state_names()
    for n in helpers.NAMES.values():
        assert f"param:{n}" in names
    ops = {str(n.target): n.meta.get(OVERRIDE_KEY) for n in step.graph.nodes if "recir." in str(n.target)}
    assert ops == {
        "recir.check_jagged.default": "recir-embedding-check",
        "recir.embedding_bag.default": "recir-embedding-bag",
        "recir.embedding.default": "recir-embedding-collection",
    }
    # one lookup per table (t1 serves f1 and f2 in one op)
    assert sum("embedding_bag" in str(n.target) for n in step.graph.nodes) == 2


def test_kjt_during_capture_asks_for_a_jagged_batch(helpers):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    kjt = helpers.random_kjt(torch.Generator().manual_seed(0))
    kjt_plain = type(kjt)(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths())
    with pytest.raises(CaptureError, match="put a recir.embedding.JaggedBatch in the batch"):
        build_step(model, helpers.loss_fn, {"features": kjt_plain, "y": torch.zeros(helpers.B)}, "sgd")


def test_missing_feature_is_a_capture_error(helpers):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    jb = JaggedBatch(["f1"], torch.zeros(4, dtype=torch.int64), torch.ones(4, dtype=torch.int64), 4, [4])
    with pytest.raises(CaptureError, match="feature 'f2' of its tables is not in the batch"):
        model(jb)


def test_dense_tbe_stand_in_matches_fbgemm_and_trains_sparsely():
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import DenseTableBatchedEmbeddingBagsCodegen
    from recir.embedding import prepare_for_lowering

    torch.manual_seed(0)
    tbe = DenseTableBatchedEmbeddingBagsCodegen(
        [(10, 4), (6, 4)], feature_table_map=[0, 0, 1], pooling_mode=PoolingMode.MEAN, use_cpu=True
    )
    holder = torch.nn.Module()
    holder.tbe = tbe
    model, applied = apply_overrides(copy.deepcopy(holder), [DenseTBEOverride()])
    assert applied and applied[0][0] == "tbe"
    indices = torch.tensor([1, 1, 9, 0, 3, 5, 5, 2])
    offsets = torch.tensor([0, 2, 3, 5, 5, 7, 8])  # 3 features x B=2
    want = tbe(indices, offsets)
    got = model.tbe(indices, offsets)
    torch.testing.assert_close(got, want)
    (gw,) = torch.autograd.grad(want.pow(2).sum(), tbe.weights)
    (gs,) = torch.autograd.grad(got.pow(2).sum(), model.tbe.weights)
    torch.testing.assert_close(gs, gw)

    def loss_fn(m, b):
        return m.tbe(b["indices"], b["offsets"]).pow(2).sum()

    batch = {"indices": indices, "offsets": offsets}
    step = build_step(model, loss_fn, batch, "adagrad")
    lowered = prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu")
    assert lowered.meta["recir.embedding"]["sparsify"]["sparsified"] == ["param:tbe.weights"]
    state = lowered.init_state(model)
    dense_state, _ = step(state, batch)
    sparse_state, _ = lowered(state, batch)
    for a, b in zip(dense_state, sparse_state):
        torch.testing.assert_close(a, b)


def test_pad_to_bucket_batches_share_one_capture(helpers):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    gen = torch.Generator().manual_seed(5)
    batch, _ = helpers.random_batch(gen)
    step = build_step(model, helpers.loss_fn, batch, "sgd")  # lr 0.1
    state = step.init_state(model)
    eager = copy.deepcopy(tr)  # TorchRec itself on the unpadded KJTs
    opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    id_counts = set()
    for i in range(3):
        kjt = helpers.random_kjt(gen)
        id_counts.add(int(kjt.lengths().sum()))
        jb, report = pad_to_bucket(kjt, [helpers.BUCKET])
        assert set(report.capacity.values()) == {helpers.BUCKET}
        y = torch.randn(helpers.B, generator=gen)
        # the padded batch has the captured shapes: the one capture serves every batch
        leaves = step.signature.flatten_batch({"features": jb, "y": y})
        assert [tuple(t.shape) for t in leaves] == [s.shape for s in step.signature.batch]
        state, (loss,) = step(state, {"features": jb, "y": y})
        opt.zero_grad()
        want = helpers.loss_fn(eager, {"features": kjt, "y": y})
        want.backward()
        opt.step()
        torch.testing.assert_close(loss, want.detach(), msg=f"loss at step {i}")
    assert len(id_counts) > 1, "the batches should differ in their number of ids"
    got = dict(zip((s.name for s in step.signature.state), state))
    for name, p in eager.named_parameters():
        torch.testing.assert_close(got[f"param:{name}"], p.detach(), msg=name)


def test_weighted_ebc_matches_torchrec():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=3, num_embeddings=9, feature_names=["a", "b"])],
        is_weighted=True,
    )
    holder = torch.nn.Module()
    holder.ebc = ebc
    model, _ = apply_overrides(copy.deepcopy(holder), overrides())
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.tensor([1, 1, 8, 0, 4]),
        lengths=torch.tensor([2, 1, 0, 2]),
        weights=torch.tensor([0.5, 2.0, -1.0, 3.0, 0.25]),
    )
    jb = JaggedBatch.from_kjt(kjt, [4, 4])
    want = ebc(kjt).values()
    got = model.ebc(jb).values()
    torch.testing.assert_close(got, want)
    (gw,) = torch.autograd.grad(want.sin().sum(), ebc.embedding_bags["t"].weight)
    (gs,) = torch.autograd.grad(got.sin().sum(), model.ebc.embedding_bags["t"].weight)
    torch.testing.assert_close(gs, gw)
