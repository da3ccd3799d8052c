"""DLRMv3 pieces against small hand-computed references: mask, position/time buckets, time features,
the STU layer (against a per-token loop), the action encoder and the multitask loss."""

import math

import pytest
import torch
import torch.fx.experimental.proxy_tensor
import torch.nn.functional as F
from recir.dlrmv3._layers import (
    STULayer,
    TargetAwareMask,
    attention_mask,
    position_ids,
    time_buckets,
    time_features,
    token_order,
    valid_tokens,
)
from recir.dlrmv3._model import ActionEncoder, multitask_loss


def test_dlrmv3_mask_is_target_aware_causal_and_skips_padding():
    # 1 contextual token, UIH padded to 3 with 2 real events, 2 candidate slots with 1 real candidate.
    valid = valid_tokens(1, 3, torch.tensor([2]), torch.tensor([1]), 2)
    assert valid.tolist() == [[True, True, True, False, True, False]]
    mask = attention_mask(valid, token_order(1, 3, 2))[0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0, 0],  # contextual: itself
        [1, 1, 0, 0, 0, 0],  # UIH 0: contextual + itself
        [1, 1, 1, 0, 0, 0],  # UIH 1
        [0, 0, 0, 0, 0, 0],  # padded UIH slot: nothing
        [1, 1, 1, 0, 1, 0],  # candidate: all real history, itself, never the padding
        [0, 0, 0, 0, 0, 0],  # padded candidate
    ]


def test_dlrmv3_two_candidates_never_see_each_other():
    valid = valid_tokens(0, 2, torch.tensor([2]), torch.tensor([2]), 2)
    mask = attention_mask(valid, token_order(0, 2, 2))[0].int().tolist()
    assert mask[2] == [1, 1, 1, 0] and mask[3] == [1, 1, 0, 1]


def test_dlrmv3_position_ids_match_the_reference_formula():
    # Reference (jagged, S = 2 ctx + 3 UIH + 2 candidates): positions [0, 1, 5, 4, 3, 2, 2].
    pos = position_ids(2, 4, 2, torch.tensor([3]), num_buckets=100)
    real = [0, 1, 2, 3, 4, 6, 7]  # slot 5 is the padded 4th UIH event
    assert [pos[0, j].item() for j in real] == [0, 1, 5, 4, 3, 2, 2]
    assert position_ids(0, 5, 1, torch.tensor([5]), num_buckets=3)[0].tolist() == [2, 2, 2, 2, 1, 0]


def test_dlrmv3_time_buckets_sqrt_minutes_clamped():
    ts = torch.tensor([[0, 7140, 3600, 7200]])
    assert time_buckets(torch.tensor([7200]), ts, num_buckets=2048).tolist() == [[10, 1, 7, 0]]
    assert time_buckets(torch.tensor([7200]), ts, num_buckets=8).tolist() == [[8, 1, 7, 0]]
    # epoch-scale timestamps stay exact: deltas are taken in int64 first
    t0 = 1_700_000_000
    assert time_buckets(torch.tensor([t0 + 3600]), torch.tensor([[t0]]), 2048).tolist() == [[7]]


def test_dlrmv3_time_features_hour_and_day():
    f = time_features(torch.tensor([0, 6 * 3600, 86400 + 12 * 3600]))
    expect = [
        [1, 0, 1, 0],  # midnight, day 0
        [0, 1, 1, 0],  # 06:00: a quarter turn of the hour cycle
        [-1, 0, math.cos(2 * math.pi / 7), math.sin(2 * math.pi / 7)],  # 12:00 on day 1
    ]
    torch.testing.assert_close(f, torch.tensor(expect, dtype=torch.float32), atol=1e-6, rtol=0)


def _stu_reference(layer: STULayer, x: torch.Tensor, mask: torch.Tensor, n: float) -> torch.Tensor:
    """Per sample, per query token, per head loops (no batching tricks)."""
    B, N, D = x.shape
    H, A = layer.num_heads, layer.head_dim
    out = torch.empty_like(x)
    for b in range(B):
        normed = F.layer_norm(x[b], (D,), layer.input_norm.weight, layer.input_norm.bias)
        uvqk = normed @ layer.uvqk.weight.T + layer.uvqk.bias
        u, v, q, k = uvqk[:, :H * A], uvqk[:, H * A:2 * H * A], uvqk[:, 2 * H * A:3 * H * A], uvqk[:, 3 * H * A:]  # fmt: skip
        u = u * torch.sigmoid(u)
        for i in range(N):
            heads = []
            for h in range(H):
                acc = torch.zeros(A, dtype=x.dtype)
                for j in range(N):
                    if mask[b, i, j]:
                        s = (q[i, h * A : (h + 1) * A] @ k[j, h * A : (h + 1) * A]) * layer.alpha
                        acc = acc + (s * torch.sigmoid(s) / n) * v[j, h * A : (h + 1) * A]
                heads.append(acc)
            attn = torch.cat(heads)
            y = u[i] * F.layer_norm(attn, (H * A,), layer.attn_norm.weight, layer.attn_norm.bias)
            out[b, i] = x[b, i] + layer.output.weight @ torch.cat([u[i], attn, y])
    return out


def test_dlrmv3_stu_layer_matches_a_loop_reference():
    torch.manual_seed(0)
    layer = STULayer(dim=8, num_heads=2, head_dim=4, dropout=0.0).double().eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    valid = valid_tokens(1, 3, torch.tensor([3, 1]), torch.tensor([2, 1]), 2)
    mask = attention_mask(valid, token_order(1, 3, 2))
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    got = layer(x, mask, torch.tensor(6))
    torch.testing.assert_close(got, _stu_reference(layer, x, mask, 6.0))


def test_dlrmv3_blocked_attention_equals_dense_with_gradients():
    # Row blocks read only the keys up to their last row (the mask is causal): same values and gradients.
    torch.manual_seed(0)
    valid = valid_tokens(2, 9, torch.tensor([9, 4, 0]), torch.tensor([3, 1, 2]), 3)
    mask = attention_mask(valid, token_order(2, 9, 3))  # N = 14
    x = torch.randn(3, 14, 8, dtype=torch.float64)
    dense = STULayer(dim=8, num_heads=2, head_dim=4, dropout=0.0, attention_blocks=1).double()
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ref_out = dense(x, mask, torch.tensor(14))
    ref_grads = torch.autograd.grad(ref_out.square().sum(), list(dense.parameters()))
    for blocks in (2, 3, 14):
        dense.attention_blocks = blocks
        out = dense(x, mask, torch.tensor(14))
        grads = torch.autograd.grad(out.square().sum(), list(dense.parameters()))
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)


def test_dlrmv3_factored_mask_equals_the_dense_mask_with_gradients():
    # TargetAwareMask (what DLRMv3.forward passes) computes without a [B, N, N] mask: same values and
    # gradients as its dense form, for padded history, padded candidates, an empty history and row blocks.
    torch.manual_seed(0)
    lengths, ncand = torch.tensor([9, 4, 0]), torch.tensor([3, 1, 2])
    factored = TargetAwareMask(valid_tokens(2, 9, lengths, ncand, 3), prefix=2 + 9)
    dense = factored.dense()
    assert torch.equal(dense, attention_mask(factored.valid, token_order(2, 9, 3)))
    x = torch.randn(3, 14, 8, dtype=torch.float64, requires_grad=True)
    layer = STULayer(dim=8, num_heads=2, head_dim=4, dropout=0.0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ref_out = layer(x, dense, torch.tensor(14))
    ref_grads = torch.autograd.grad(ref_out.square().sum(), [x, *layer.parameters()])
    for blocks in (1, 2, 3, 14):
        layer.attention_blocks = blocks
        out = layer(x, factored, torch.tensor(14))
        grads = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    # no [B, N, N] tensor in the traced attention: the scores are [B, H, N, prefix]
    q = k = v = torch.zeros(3, 2, 14, 4)
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda q, k, v, valid, n: STULayer(8, 2, 4, 0.0).attention(q, k, v, TargetAwareMask(valid, 11), n)
    )(q, k, v, factored.valid, torch.tensor(14))
    shapes = {tuple(n.meta["val"].shape) for n in graph.graph.nodes if "val" in n.meta}
    assert (3, 2, 14, 11) in shapes and not any(s[-2:] == (14, 14) for s in shapes)


@pytest.mark.parametrize("per_sample_scale", [False, True])
def test_dlrmv3_recomputed_attention_equals_the_kept_scores_with_gradients(per_sample_scale):
    # With STULayer.recompute_scores the factored attention's backward recomputes each row block's
    # scores (the recir::hstu_attention op): the same values and gradients (input and every parameter) as
    # autograd through the kept scores, for padded history, padded candidates, an empty history and row
    # blocks, and the forward keeps nothing of [B, H, rows, keys] for the backward.
    torch.manual_seed(0)
    lengths, ncand = torch.tensor([9, 4, 0]), torch.tensor([3, 1, 2])
    mask = TargetAwareMask(valid_tokens(2, 9, lengths, ncand, 3), prefix=2 + 9)
    B, N, D, H, A = 3, 14, 8, 2, 4
    x = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    layer = STULayer(dim=D, num_heads=H, head_dim=A, dropout=0.0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    scale = torch.tensor([14.0, 12.0, 9.0])[:, None, None, None] if per_sample_scale else torch.tensor(14)
    params = [x, *layer.parameters()]

    def run(recompute: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[int]]:
        layer.recompute_scores = recompute
        u, q, k, v = layer.project(x)
        saved: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attn = layer.attention(q, k, v, mask, scale)
        out = layer.combine(x, u, attn)
        return out, torch.autograd.grad(out.square().sum(), params), saved

    for blocks in (1, 2, 3, 14):
        layer.attention_blocks = blocks
        ref_out, ref_grads, kept = run(False)
        out, grads, saved = run(True)
        torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
        for name, g, r in zip(
            ["x", *(n for n, _ in layer.named_parameters())], grads, ref_grads, strict=True
        ):
            torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)
        # q, k, v (and the mask and scale) only; autograd keeps the scores, and more in all
        assert max(saved) <= B * H * N * A and sum(saved) < sum(kept) - B * H * N * 11


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_dlrmv3_candidate_rows_equal_the_whole_layers_with_gradients(layout):
    # STULayer.forward_candidates (DLRMv3's last layer) computes the query side for the candidate slots
    # only: their rows and every gradient (input, parameters) equal the whole layer's candidate rows,
    # for padded history, padded candidates and an empty history, on padded and packed inputs.
    torch.manual_seed(0)
    lengths, ncand = torch.tensor([9, 4, 0]), torch.tensor([3, 1, 2])
    mask = TargetAwareMask(valid_tokens(2, 9, lengths, ncand, 3), prefix=2 + 9)
    B, N, D = 3, 14, 8
    x = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    layer = STULayer(dim=D, num_heads=2, head_dim=4, dropout=0.0).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    index = mask.valid.reshape(-1).nonzero().squeeze(1)  # the real tokens' slots, as a token budget packs
    weight = torch.randn(B, 3, D, dtype=torch.float64)  # candidate rows weighted by a random cotangent
    if layout == "padded":
        whole = layer(x, mask, torch.tensor(N))[:, 11:]
        cand = layer(x, mask, torch.tensor(N), candidates_only=True)
    else:
        rows = x.reshape(B * N, D)[index]
        out = layer(rows, mask, torch.tensor(N), packed=(index, (B, N)))
        whole = out.new_zeros(B * N, D).index_copy(0, index, out).view(B, N, D)[:, 11:]
        cand = layer(rows, mask, torch.tensor(N), packed=(index, (B, N)), candidates_only=True)
    real = torch.arange(3)[None, :] < ncand[:, None]
    weight = weight * real[..., None]  # padded candidates: packed rows leave them out
    assert cand.shape == (B, 3, D)
    torch.testing.assert_close(cand[real], whole[real], rtol=1e-12, atol=1e-12)
    params = [x, *layer.parameters()]
    ref = torch.autograd.grad((whole * weight).sum(), params, allow_unused=True, retain_graph=True)
    got = torch.autograd.grad((cand * weight).sum(), params, allow_unused=True)
    for name, g, r in zip(["x", *(n for n, _ in layer.named_parameters())], got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12, msg=name)
    assert float(ref[0][:, :11].abs().sum()) > 0  # the history rows get gradient through keys and values
    # the query side's products run on the candidate rows only: no [rows, H * A] q or u product
    graph = torch.fx.experimental.proxy_tensor.make_fx(
        lambda x: layer(x, mask, torch.tensor(N), candidates_only=True)
    )(x.detach())
    products = [
        n for n in graph.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    ]
    assert sorted(n.meta["val"].shape[0] for n in products) == [B * 3] * 3 + [B * N] * 2


def test_dlrmv3_attention_blocks_automatic_and_checked():
    layer = STULayer(dim=8, num_heads=2, head_dim=4, dropout=0.0)
    q = k = v = torch.zeros(1, 2, STULayer.BLOCKED_FROM, 4)
    mask = torch.ones(1, STULayer.BLOCKED_FROM, STULayer.BLOCKED_FROM, dtype=torch.bool)
    trace = torch.fx.experimental.proxy_tensor.make_fx(lambda *args: layer.attention(*args))
    graph = trace(q, k, v, mask, torch.tensor(1))
    assert sum(n.target == torch.ops.aten.cat.default for n in graph.graph.nodes) == 1  # two blocks joined
    short = [t[:, :, :-1] for t in (q, k, v)]
    graph = trace(*short, mask[:, :-1, :-1], torch.tensor(1))
    assert not any(n.target == torch.ops.aten.cat.default for n in graph.graph.nodes)  # dense below it
    with pytest.raises(ValueError, match="attention_blocks must be >= 1"):
        STULayer(dim=8, num_heads=2, head_dim=4, dropout=0.0, attention_blocks=0)


def test_dlrmv3_action_encoder_sums_learned_vectors_per_set_bit():
    enc = ActionEncoder((1, 2, 4), dim=2)
    with torch.no_grad():
        enc.table.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]))
    out = enc(torch.tensor([[5, 0]]), num_candidates=1)
    assert out.shape == (1, 3, 6)
    assert out[0, 0].tolist() == [1, 2, 0, 0, 5, 6]  # bits 1 and 4
    assert out[0, 1].tolist() == [0] * 6
    assert torch.equal(out[0, 2], enc.target.detach())


def test_dlrmv3_multitask_loss_by_hand():
    logits = torch.zeros(1, 2, 2)
    labels = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    weights = torch.tensor([[1.0, 0.0]])  # the second candidate is padding
    assert math.isclose(multitask_loss(logits, labels, weights).item(), 0.2 * 2 * math.log(2), rel_tol=1e-6)
    logits = torch.tensor([[[2.0, -1.0], [5.0, 5.0]]])
    expect = 0.2 * (math.log1p(math.exp(-2)) + math.log1p(math.exp(-1)))
    assert math.isclose(multitask_loss(logits, labels, weights).item(), expect, rel_tol=1e-6)
