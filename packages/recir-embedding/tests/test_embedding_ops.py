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


@pytest.mark.parametrize("mode", [0, 1])
def test_backend_bag_kernels_match_the_core_op(mode):
    w = torch.randn(11, 5)
    ids = torch.tensor([3, 3, 10, 0, 7, 7, 7])
    offsets = torch.tensor([0, 2, 2, 5, 7])  # an empty bag too
    want = torch.ops.recir.embedding_bag(w, ids, offsets, None, mode)
    for op in (torch.ops.recir.fbgemm_embedding_bag, torch.ops.recir.torchrec_embedding_bag):
        torch.library.opcheck(
            op.default, (w, ids, offsets, None, mode), test_utils=("test_schema", "test_faketensor")
        )
        torch.testing.assert_close(op(w, ids, offsets, None, mode), want)


def test_backend_sequence_kernels_match_the_reference():
    w = torch.randn(11, 5)
    ids = torch.tensor([3, 3, 10, 0])
    for op in (torch.ops.recir.fbgemm_embedding, torch.ops.recir.torchrec_embedding):
        torch.testing.assert_close(op(w, ids), w[ids])
