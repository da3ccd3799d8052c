"""recir-embedding's ops: recir::embedding (fake impl, gradient form, reference) and the backend kernels."""

from __future__ import annotations

import pytest
import torch
from recir.embedding import embedding_reference
from recir.transforms import override_for_op
from torch.fx.experimental.proxy_tensor import make_fx


def test_embedding_op_opcheck_and_reference():
    w = torch.randn(7, 3, requires_grad=True)
    ids = torch.tensor([1, 6, 1, 0])
    torch.library.opcheck(torch.ops.recir.embedding.default, (w, ids))
    out = torch.ops.recir.embedding(w, ids)
    torch.testing.assert_close(out, embedding_reference(w, ids))
    g = torch.randn(4, 3)
    (gw,) = torch.autograd.grad(out, w, g)
    torch.testing.assert_close(gw, torch.zeros(7, 3).index_add(0, ids, g))
    assert override_for_op(torch.ops.recir.embedding.default) == "recir-embedding-collection"


def test_embedding_gradient_is_zeros_index_add_in_the_graph():
    def f(w, ids, g):
        w = w.detach().requires_grad_()
        with torch.enable_grad():
            return torch.autograd.grad(torch.ops.recir.embedding(w, ids), w, g)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(7, 3), torch.tensor([1, 2]), torch.randn(2, 3))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.index_add.default in targets
    assert torch.ops.aten.new_zeros.default in targets


def _bags_by_hand(w, ids, offsets, mode, weights=None):
    """Bag b pools ``w[ids[offsets[b]:offsets[b+1]]]`` in a Python loop: no F.embedding_bag in sight."""
    out = torch.zeros(len(offsets) - 1, w.shape[1])
    for b in range(len(offsets) - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        for j in range(lo, hi):
            out[b] += w[ids[j]] * (1.0 if weights is None else weights[j])
        if mode == 1 and hi > lo:
            out[b] /= hi - lo
    return out


@pytest.mark.parametrize("mode", [0, 1])
def test_backend_bag_kernels_match_the_core_op(mode):
    pytest.importorskip("fbgemm_gpu")
    w = torch.randn(11, 5)
    ids = torch.tensor([3, 3, 10, 0, 7, 7, 7])
    offsets = torch.tensor([0, 2, 2, 5, 7])  # an empty bag too
    want = _bags_by_hand(w, ids, offsets, mode)
    torch.testing.assert_close(torch.ops.recir.embedding_bag(w, ids, offsets, None, mode), want)
    for op in (torch.ops.recir.fbgemm_embedding_bag, torch.ops.recir.torchrec_embedding_bag):
        torch.library.opcheck(
            op.default, (w, ids, offsets, None, mode), test_utils=("test_schema", "test_faketensor")
        )
        torch.testing.assert_close(op(w, ids, offsets, None, mode), want, msg=str(op))
    if mode == 0:
        psw = torch.tensor([0.5, 2.0, 1.0, -1.0, 0.0, 3.0, 0.25])
        want_w = _bags_by_hand(w, ids, offsets, 0, psw)
        for op in (torch.ops.recir.fbgemm_embedding_bag, torch.ops.recir.torchrec_embedding_bag):
            torch.testing.assert_close(op(w, ids, offsets, psw, 0), want_w, msg=str(op))


@pytest.mark.parametrize("pooling", ["SUM", "MEAN"])
def test_torchrec_backend_matches_torchrec_itself(pooling):
    # The kernel the torchrec backend stands for: TorchRec's own EmbeddingBagCollection on a KJT.
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name="t",
                embedding_dim=5,
                num_embeddings=11,
                feature_names=["f"],
                pooling=PoolingType[pooling],
            )
        ]
    )
    lengths = torch.tensor([2, 0, 3, 2])
    ids = torch.tensor([3, 3, 10, 0, 7, 7, 7])
    want = ebc(KeyedJaggedTensor(keys=["f"], values=ids, lengths=lengths)).values()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    w = ebc.embedding_bags["t"].weight.detach()
    got = torch.ops.recir.torchrec_embedding_bag(w, ids, offsets, None, int(pooling == "MEAN"))
    torch.testing.assert_close(got, want.detach())


def test_backend_sequence_kernels_match_the_reference():
    pytest.importorskip("fbgemm_gpu")
    w = torch.randn(11, 5)
    ids = torch.tensor([3, 3, 10, 0])
    for op in (torch.ops.recir.fbgemm_embedding, torch.ops.recir.torchrec_embedding):
        torch.testing.assert_close(op(w, ids), w[ids])
