"""End to end: a TorchRec EBC/EC model captured by recir.capture with recir.embedding.overrides(),
checked against eager TorchRec for 10 steps through the StepGraph interpreter and both lowerings."""

from __future__ import annotations

import copy

import pytest
import torch
from recir.embedding import RowWiseAdagrad, overrides, prepare_for_lowering

capture = pytest.importorskip("recir.capture")

TABLES = ("ebc.embedding_bags.t1.weight", "ebc.embedding_bags.t2.weight", "ec.embeddings.s1.weight")


def _optimizer(kind, params):
    if kind == "adagrad":
        return torch.optim.Adagrad(params, lr=0.1)
    if kind == "rowwise_adagrad":
        return RowWiseAdagrad(params, lr=0.1)
    return torch.optim.SGD(params, lr=0.1)


def _run_parity(helpers, kind, run_step, n_steps=10, rtol=1e-5, atol=1e-6):
    """Train eager TorchRec (KJT batches) and ``run_step`` (JaggedBatch batches) side by side."""
    eager = helpers.make_torchrec_model()
    eager_opt = _optimizer(kind, eager.parameters())
    model = copy.deepcopy(eager)
    step = capture.capture_train_step(
        model,
        _optimizer(kind, model.parameters()),
        helpers.loss_fn,
        helpers.random_batch(torch.Generator().manual_seed(0))[0],
        overrides=overrides(),
    )
    params = dict(eager.named_parameters())
    state_dict_of, call, state = run_step(step, model, _optimizer(kind, model.parameters()))
    gen = torch.Generator().manual_seed(11)
    for i in range(n_steps):
        batch, kjt = helpers.random_batch(gen)
        eager_opt.zero_grad()
        loss = helpers.loss_fn(eager, {"features": kjt, "y": batch["y"]})
        loss.backward()
        eager_opt.step()
        state, outputs = call(state, batch)
        got_loss = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
        torch.testing.assert_close(
            got_loss, loss.detach(), rtol=rtol, atol=atol, msg=_named(f"loss, step {i}")
        )
        sd = state_dict_of(state)
        for name in TABLES:
            p = params[name]
            torch.testing.assert_close(
                sd[f"param:{name}"], p.detach(), rtol=rtol, atol=atol, msg=_named(f"{name} {i}")
            )
            if kind != "sgd":
                torch.testing.assert_close(
                    sd[f"optim:{name}:sum"],
                    eager_opt.state[p]["sum"],
                    rtol=rtol,
                    atol=atol,
                    msg=_named(f"{name} sum {i}"),
                )
    return step


def _named(what):
    """assert_close's report (the differences) behind what was compared."""
    return lambda report: f"{what}: {report}"


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
def test_captured_torchrec_model_matches_eager_through_the_interpreter(helpers, kind):
    def interpreter(step, model, opt):
        lowered = prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu")
        assert len(lowered.meta["recir.embedding"]["sparsify"]["sparsified"]) == 3
        return lowered.state_dict, lowered, lowered.init_state(model, opt)

    step = _run_parity(helpers, kind, interpreter)
    names = step.signature.state_names()
    assert "param:ebc.embedding_bags.t1.weight" in names and "param:ec.embeddings.s1.weight" in names


def test_captured_torchrec_model_through_lower_gpu(helpers):
    lower_gpu = pytest.importorskip("recir.lower_gpu")

    def gpu(step, model, opt):
        compiled = lower_gpu.compile(step, device="cpu", embedding_backend="fbgemm")
        return compiled.state_dict, compiled, compiled.init_state(model, opt)

    _run_parity(helpers, "rowwise_adagrad", gpu, n_steps=4)


@pytest.mark.tpu
def test_captured_torchrec_model_through_lower_tpu(helpers):
    lower_tpu = pytest.importorskip("recir.lower_tpu")

    def tpu(step, model, opt):
        prepared = prepare_for_lowering(step, target="tpu")
        compiled = lower_tpu.compile(prepared)
        return compiled.state_dict, compiled, compiled.init_state(model, opt)

    import jax

    # a TPU's float32 maths (its products at highest precision too) is not the host's to 1e-6: the parity
    # tests' TPU tolerance (the Adagrad sum of t2 missed 1e-6 at step 0 on a v5e)
    tol = dict(rtol=1e-4, atol=1e-5) if jax.default_backend() == "tpu" else {}
    _run_parity(helpers, "adagrad", tpu, n_steps=4, **tol)


def test_dense_adam_plus_rowwise_tables_sparsify_only_the_tables(helpers):
    """DLRM-style: dense Adam for an MLP, RowWiseAdagrad for tables; sparse == dense maths for 5 steps."""
    model = helpers.make_torchrec_model()
    model.lin = torch.nn.Linear(11, 1)

    def loss_fn(m, b):
        pooled, seq = m(b["features"])
        return (m.lin(pooled).squeeze(1) - b["y"]).pow(2).mean() + seq.sin().sum() * 0.1

    dense = [p for n, p in model.named_parameters() if n.startswith("lin")]
    tables = [p for n, p in model.named_parameters() if not n.startswith("lin")]
    opts = [torch.optim.Adam(dense, lr=0.01), RowWiseAdagrad(tables, lr=0.1)]
    batch, _ = helpers.random_batch(torch.Generator().manual_seed(0))
    step = capture.capture_train_step(model, opts, loss_fn, batch, overrides=overrides())
    ref = prepare_for_lowering(step, backend="in_graph", target="gpu", sparse_updates=False)
    sparse = prepare_for_lowering(step, backend="in_graph", target="gpu")
    stats = sparse.meta["recir.embedding"]["sparsify"]
    assert sorted(stats["sparsified"]) == sorted(f"param:{n}" for n in TABLES)
    assert set(stats["skipped"]) == {"param:lin.weight", "param:lin.bias"}
    sa, sb = ref.init_state(model, opts), sparse.init_state(model, opts)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        b, _ = helpers.random_batch(gen)
        sa, _ = ref(sa, b)
        sb, _ = sparse(sb, b)
    for name, x, y in zip(ref.signature.state_names(), sa, sb):
        torch.testing.assert_close(y, x, msg=name)
