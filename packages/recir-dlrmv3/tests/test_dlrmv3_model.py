"""The whole DLRMv3 model: padding invariance (static shapes change nothing), static-shape tracing by
make_fx in fake mode, and float64 gradients against finite differences."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from _dlrmv3_workers import random_samples
from recir.dlrmv3 import DLRMv3, ModelConfig, collate, dataset_spec, loss_fn
from recir.dlrmv3._layers import STULayer
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx


def _model(seed: int = 0, **kw) -> tuple[DLRMv3, dict[str, int]]:
    spec = dataset_spec("debug")
    cfg = ModelConfig(**{"embedding_dim": 8, "num_layers": 2, "num_heads": 2, "hash_size": 50, **kw})
    torch.manual_seed(seed)
    model = DLRMv3(spec, cfg)
    rows = {f: cfg.table_rows(t) for t in spec.tables for f in t.features}
    return model, rows


def test_dlrmv3_more_padding_changes_no_logit():
    model, rows = _model(uih_len=6, num_candidates=3)
    model.eval()
    spec = model.spec
    samples = random_samples(4)
    tight = collate(samples, spec, 6, 3, rows)
    loose = collate(samples, spec, 11, 5, rows)
    with torch.no_grad():
        a, b = model(tight), model(loose)
    torch.testing.assert_close(a, b[:, :3], atol=1e-5, rtol=1e-5)
    # and the loss ignores the padded candidates
    torch.testing.assert_close(loss_fn(model, tight)[0], loss_fn(model, loose)[0], atol=1e-5, rtol=1e-5)


class _StaticEmbeddingStandIn(nn.Module):
    """A traceable stand-in for the EmbeddingCollection: static splits of the KJT values."""

    def __init__(self, model: DLRMv3, B: int, L: int, C: int) -> None:
        super().__init__()
        self.embeddings = model.ec.embeddings
        self.sizes = [B * L, B * C] + [B] * len(model.spec.contextual)
        self.table_of = {f: t.name for t in model.spec.tables for f in t.features}
        self.keys = list(model.spec.features)

    def forward(self, kjt):  # type: ignore[no-untyped-def]
        from torchrec.sparse.jagged_tensor import JaggedTensor

        out = {}
        for key, ids in zip(self.keys, kjt.values().split(self.sizes)):
            rows = F.embedding(ids, self.embeddings[self.table_of[key]].weight)
            out[key] = JaggedTensor(values=rows, lengths=torch.ones(rows.shape[0], dtype=torch.int64))
        return out


class _Loss(nn.Module):
    def __init__(self, model: DLRMv3) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch):  # type: ignore[no-untyped-def]
        return loss_fn(self.model, batch)


@pytest.mark.parametrize("token_budget", [None, 28])
def test_dlrmv3_forward_and_backward_trace_with_static_shapes_in_fake_mode(token_budget):
    model, rows = _model(uih_len=6, num_candidates=3, input_dropout=0.2, layer_dropout=0.1)
    batch = collate(random_samples(4), model.spec, 6, 3, rows, token_budget=token_budget)
    assert batch.packed == (token_budget is not None)
    model.ec = _StaticEmbeddingStandIn(model, 4, 6, 3)  # type: ignore[assignment]
    wrapper = _Loss(model)
    params = dict(wrapper.named_parameters())
    buffers = dict(wrapper.named_buffers())
    flat, spec = pytree.tree_flatten(batch)
    present = [i for i, t in enumerate(flat) if t is not None]

    def step(params, buffers, tensors):  # type: ignore[no-untyped-def]
        leaves = list(flat)
        for i, t in zip(present, tensors):
            leaves[i] = t
        batch = pytree.tree_unflatten(leaves, spec)
        loss, logits = torch.func.functional_call(wrapper, (params, buffers), (batch,))
        grads = torch.autograd.grad(loss, list(params.values()))
        return loss, logits, grads

    gm = make_fx(step, tracing_mode="fake")(params, buffers, [flat[i] for i in present])
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("native_dropout" in t or "bernoulli" in t or "rand" in t for t in targets), "dropout traced"
    assert not [t for t in targets if "_local_scalar_dense" in t or t.endswith(".item")], targets


def test_dlrmv3_gradients_match_float64_finite_differences():
    model, rows = _model(uih_len=4, num_candidates=2, input_dropout=0.0, layer_dropout=0.0, hash_size=12)
    batch = collate(random_samples(2, seed=3, max_uih=4, max_cand=2), model.spec, 4, 2, rows)
    # TorchRec's EC computes in its table dtype (fp32); the stand-in does the same lookup in float64.
    with torch.no_grad():
        expect = model(batch)
    model.ec = _StaticEmbeddingStandIn(model, 2, 4, 2)  # type: ignore[assignment]
    with torch.no_grad():
        torch.testing.assert_close(model(batch), expect)
    model = model.double()
    names = ["ec.embeddings.post_id.weight", "layers.0.uvqk.weight", "contextual_weight", "head.2.weight"]
    params = dict(model.named_parameters())
    chosen = [params[n] for n in names]

    def f(*tensors):  # type: ignore[no-untyped-def]
        with torch.no_grad():
            saved = [p.detach().clone() for p in chosen]
            for p, t in zip(chosen, tensors):
                p.copy_(t)
        try:
            return loss_fn(model, batch)[0]
        finally:
            with torch.no_grad():
                for p, s in zip(chosen, saved):
                    p.copy_(s)

    loss = loss_fn(model, batch)[0]
    analytic = torch.autograd.grad(loss, chosen)
    eps = 1e-6
    rng = np.random.default_rng(0)
    for p, g in zip(chosen, analytic):
        flat = p.detach().reshape(-1)
        for i in rng.choice(flat.numel(), size=6, replace=False):
            plus, minus = flat.clone(), flat.clone()
            plus[i] += eps
            minus[i] -= eps
            others = [q.detach() for q in chosen]
            k = next(j for j, q in enumerate(chosen) if q is p)
            num = (
                f(*[plus.view_as(p) if j == k else others[j] for j in range(len(chosen))])
                - f(*[minus.view_as(p) if j == k else others[j] for j in range(len(chosen))])
            ) / (2 * eps)
            assert abs(float(num) - float(g.reshape(-1)[i])) < 1e-7 + 1e-5 * abs(float(num)), (p.shape, i)
    # the embedding rows that the batch touched got gradient, the padding row none
    assert float(analytic[0][0].abs().sum()) == 0.0
    assert float(analytic[0].abs().sum()) > 0.0


def test_dlrmv3_inference_graph_equals_eager_eval():
    # recir.transforms.to_inference on the captured training step: the multitask logits of model.eval()
    from recir.capture import capture_train_step
    from recir.dlrmv3 import TrainOptions
    from recir.dlrmv3._model import loss_fn
    from recir.dlrmv3._train import build
    from recir.embedding import overrides
    from recir.transforms import to_inference, verify

    opts = TrainOptions(batch_size=4, embedding_dim=16, num_layers=2, num_heads=2, uih_len=8, num_candidates=3,
                        hash_size=200)  # fmt: skip
    model, data, optimizers = build(opts)
    model.train()
    step = capture_train_step(model, optimizers, loss_fn, data.train_batch(0), overrides=overrides())
    inf = verify(to_inference(step))
    assert inf.meta["recir.inference"]["dropouts_removed"] == 3  # input dropout + one per layer
    # the head reads the candidates' rows: the model's last layer computes its query side on those rows
    # only (STULayer.forward_candidates), which leaves recir-cleanup-narrow nothing to narrow
    assert inf.meta["recir.inference"]["nodes_narrowed"] == 0
    rows = 4 * (len(model.spec.contextual) + 8 + 3)  # contextual, history and candidate tokens, padded
    products = [
        n for n in inf.graph.nodes if n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    ]
    # on the 12 candidate rows: the last layer's u, q and W_out, time_combiner, the head's and item tower's 2 each
    assert sum(n.meta["val"].shape[0] == 4 * 3 for n in products) == 8
    assert sum(n.meta["val"].shape[0] == rows for n in products) == 4  # uvqk, W_out, then v and k
    assert {s.kind for s in inf.signature.state} <= {"param", "buffer"}  # no optimizer or rng state
    sd = step.state_dict(step.init_state(model, optimizers))
    batch = data.train_batch(1)
    _, (logits,) = inf([sd[s.name] for s in inf.signature.state], batch)
    model.eval()
    with torch.no_grad():
        _, expected = loss_fn(model, batch)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)


def test_dlrmv3_packed_tokens_equal_the_padded_layout_with_gradients():
    # A token budget makes the STU layers compute the batch's real tokens only (Batch.token_index);
    # the real candidates' logits, the loss and every gradient equal the padded layout's in float64.
    model, rows = _model(uih_len=6, num_candidates=3, input_dropout=0.0, layer_dropout=0.0)
    samples = random_samples(4, seed=5)
    padded = collate(samples, model.spec, 6, 3, rows)
    real = int(padded.uih_lengths.sum() + padded.num_candidates.sum()) + 4 * len(model.spec.contextual)
    assert real < padded.num_slots
    model.ec = _StaticEmbeddingStandIn(model, 4, 6, 3)  # type: ignore[assignment]
    model = model.double()
    results = []
    for budget in (None, real, real + 3):
        batch = collate(samples, model.spec, 6, 3, rows, token_budget=budget)
        assert batch.packed == (budget is not None)
        assert int(batch.token_index.shape[0]) == (budget or padded.num_slots)
        model.zero_grad()
        loss, logits = loss_fn(model, batch)
        loss.backward()
        results.append(
            (loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    cand = torch.arange(3)[None, :] < padded.num_candidates[:, None]
    for loss, logits, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(logits[cand], results[0][1][cand], atol=1e-12, rtol=1e-12)
        for name, g in grads.items():
            torch.testing.assert_close(g, results[0][2][name], atol=1e-12, rtol=1e-12, msg=name)
    assert float(results[1][2]["layers.1.uvqk.weight"].abs().sum()) > 0


@pytest.mark.parametrize("token_budget", [None, "real"])
def test_dlrmv3_factored_and_dense_masks_train_the_same(monkeypatch, token_budget):
    # DLRMv3.FACTORED_MASK_FROM picks the STU mask's form by the candidates' share of the slots; both
    # forms give the same loss, logits and every gradient (float64, padded and packed layouts).
    model, rows = _model(uih_len=6, num_candidates=3, input_dropout=0.0, layer_dropout=0.0)
    samples = random_samples(4, seed=7)
    padded = collate(samples, model.spec, 6, 3, rows)
    real = int(padded.uih_lengths.sum() + padded.num_candidates.sum()) + 4 * len(model.spec.contextual)
    batch = collate(samples, model.spec, 6, 3, rows, token_budget=real if token_budget else None)
    model.ec = _StaticEmbeddingStandIn(model, 4, 6, 3)  # type: ignore[assignment]
    model = model.double()
    seen: list[str] = []
    attention = STULayer.attention

    def spy(self, q, k, v, mask, max_len):  # type: ignore[no-untyped-def]
        seen.append(type(mask).__name__)
        return attention(self, q, k, v, mask, max_len)

    monkeypatch.setattr(STULayer, "attention", spy)
    results = []
    for share in (0.0, 1.0):  # 3 candidates of 9 + contextual slots: factored, then dense
        monkeypatch.setattr(DLRMv3, "FACTORED_MASK_FROM", share)
        model.zero_grad()
        loss, logits = loss_fn(model, batch)
        loss.backward()
        results.append(
            (loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        )
    # the first layer's attention (the last layer's candidate rows take the factored form either way)
    assert seen == ["TargetAwareMask", "Tensor"]
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-12, rtol=1e-12)
    for name, g in results[0][2].items():
        torch.testing.assert_close(g, results[1][2][name], atol=1e-12, rtol=1e-12, msg=name)
    assert float(results[0][2]["layers.1.uvqk.weight"].abs().sum()) > 0
