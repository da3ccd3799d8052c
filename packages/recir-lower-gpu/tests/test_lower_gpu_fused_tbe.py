"""``embedding_backend="fbgemm"``: FBGEMM's split TBE with its fused backward + optimizer trains the tables
outside the compiled graph (fbgemm-gpu-cpu's kernels on the CPU device here; the CUDA build is the same
code path). Parity is against the in-graph backend's step (the same captured step with recir-embedding's
row-wise update and ATen lookups) run by the reference interpreter: 20 steps, every parameter and optimizer
state slot within 1e-5. The model has a sum-pooled table with per-sample weights and a mean-pooled one.
"""

from __future__ import annotations

import logging

import pytest
import recir.lower_gpu as lg
import torch
from recir.capture import capture_train_step, testing
from recir.embedding import FusedTBE, RowWiseAdagrad, fused_tbe_tables, prepare_for_lowering
from recir.lower_gpu import FusedTBECompiledStep

pytest.importorskip("fbgemm_gpu")
ATOL = 1e-5
STEPS = 20
CASE = testing.REFERENCE_CASES["embedding_bag"]
TABLES = ["param:tables.0.weight", "param:tables.1.weight"]
OPTIMIZERS = {
    "rowwise_adagrad": lambda ps: RowWiseAdagrad(ps, lr=0.05, eps=1e-8),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, eps=1e-8),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    # tables.0 row-wise Adagrad (fused); everything else, tables.1 included, Adam (not fused: in the graph)
    "mixed": lambda model: [
        RowWiseAdagrad([model.tables[0].weight], lr=0.05, eps=1e-8),
        torch.optim.Adam([p for n, p in model.named_parameters() if n != "tables.0.weight"], lr=0.01),
    ],
}


def _captured(opt_name: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    model = CASE.build(seed=0).to(device)
    make = OPTIMIZERS[opt_name]
    optimizer = make(model) if opt_name == "mixed" else make(model.parameters())
    example = _on(CASE.make_batch(0), device)
    step = capture_train_step(model, optimizer, CASE.loss_fn, example, overrides=CASE.overrides())
    return model, optimizer, step


def _on(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _max_errors(got: dict, want: dict) -> dict[str, float]:
    assert sorted(got) == sorted(want)
    return {k: float((got[k].float() - want[k].float()).abs().max()) for k in want if want[k].numel()}


@pytest.mark.parametrize("opt_name", ["rowwise_adagrad", "adagrad", "sgd", "mixed"])
def test_fused_tbe_matches_the_in_graph_backend_for_20_steps(opt_name, lower_gpu_cache_dir, caplog):
    _parity(opt_name, "cpu", lower_gpu_cache_dir, caplog)


@pytest.mark.gpu
@pytest.mark.parametrize("opt_name", ["rowwise_adagrad", "mixed"])
def test_fused_tbe_on_cuda_matches_the_in_graph_backend(opt_name, lower_gpu_cache_dir, caplog):
    from recir.embedding._ops import fbgemm_has_cuda

    if not fbgemm_has_cuda():
        pytest.skip("FBGEMM's CUDA build (fbgemm-gpu) is not installed")
    _parity(opt_name, "cuda", lower_gpu_cache_dir, caplog)


def _parity(opt_name: str, device: str, cache_dir: str, caplog) -> None:  # type: ignore[no-untyped-def]
    model, optimizer, step = _captured(opt_name, device)
    with caplog.at_level(logging.INFO, logger="recir.lower_gpu"):
        compiled = lg.compile(
            step, device=device, embedding_backend="fbgemm", options=lg.GPUOptions(cache_dir=cache_dir)
        )
    assert isinstance(compiled, FusedTBECompiledStep)
    fused = TABLES[:1] if opt_name == "mixed" else TABLES
    assert sorted(compiled.split.tables) == fused
    if opt_name == "mixed":  # the Adam table keeps FBGEMM's forward kernel in the graph, and says why
        assert "table param:tables.1.weight keeps FBGEMM's forward kernel" in caplog.text
        assert "'adam' has no fused FBGEMM form" in caplog.text
        kernels = [n for n in compiled.dense.step.graph.nodes if str(n.target).startswith("recir.fbgemm_")]
        assert len(kernels) == 1
    ref = prepare_for_lowering(step, backend="in_graph", target="gpu", device=device)
    ref_state = ref.init_state(model, optimizer)
    state = compiled.init_state(model, optimizer)
    # the tables (and their optimizer state) are TBE's own buffers, trained in place
    views = compiled.tbe.views()
    assert [state[i].data_ptr() for i in compiled.split.host_slots] == [v.data_ptr() for v in views]
    for i in range(STEPS):
        batch = _on(CASE.make_batch(i), device)
        state, out = compiled(state, batch)
        ref_state, ref_out = ref(ref_state, batch)
        torch.testing.assert_close(out[0], ref_out[0], rtol=0, atol=ATOL)
        if i == STEPS // 2:  # a checkpoint round trip mid-run: the state goes back into TBE's buffers
            snapshot = {k: v.clone() for k, v in compiled.state_dict(state).items()}
            state = compiled.load_state_dict(snapshot)
    errors = _max_errors(compiled.state_dict(state), ref.state_dict(ref_state))
    assert max(errors.values()) <= ATOL, errors
    moved = [t for t in fused if errors[t] == 0.0 and t in compiled.split.tables]
    assert not moved or opt_name == "sgd", f"tables never updated? {moved}"


def test_unfusable_tables_and_their_reasons():
    # Adam has no fused CPU kernel; weight decay and lr decay are not fused; nothing fused: no split at all
    _, _, step = _captured("mixed")
    marked = prepare_for_lowering(step, backend="fbgemm", target="gpu", device="cpu", host_tables=True)
    tables, reasons = fused_tbe_tables(marked)
    assert tables == TABLES[:1] and list(reasons) == TABLES[1:]
    assert "optimizer 'adam'" in reasons[TABLES[1]] and "no CPU kernel" in reasons[TABLES[1]]
    model = CASE.build(seed=0)
    for opt, why in [
        (torch.optim.Adagrad(model.parameters(), lr=0.1, weight_decay=0.01), "weight_decay=0.01"),
        (torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.1), "lr_decay=0.1"),
        (torch.optim.SGD(model.parameters(), lr=0.1, maximize=True), "maximize=True"),
    ]:
        step = capture_train_step(model, opt, CASE.loss_fn, CASE.make_batch(0), overrides=CASE.overrides())
        marked = prepare_for_lowering(step, backend="fbgemm", target="gpu", device="cpu", host_tables=True)
        tables, reasons = fused_tbe_tables(marked)
        assert tables == [] and all(why in r for r in reasons.values()), reasons


def test_fused_tbe_loads_state_into_its_buffers_and_checks_call_order():
    model, optimizer, step = _captured("rowwise_adagrad")
    from recir.embedding import split_host

    split = split_host(
        prepare_for_lowering(step, backend="fbgemm", target="gpu", device="cpu", host_tables=True)
    )
    tbe = FusedTBE(split, "cpu")
    state = step.init_state(model, optimizer)
    host = [state[i] + 1.0 for i in split.host_slots]  # tables and their row-wise Adagrad sums
    views = tbe.load(host)
    assert [v.data_ptr() for v in views] == [v.data_ptr() for v in tbe.views()]
    for got, want in zip(tbe.views(), host):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(Exception, match="expected shape"):
        tbe.load([h[:1] for h in host])
    with pytest.raises(Exception, match="call lookup"):
        tbe.backward([])
    with pytest.raises(Exception, match="learning rate"):
        tbe.lookup(tbe.views(), step.signature.flatten_batch(CASE.make_batch(0)), [])
