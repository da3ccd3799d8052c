"""20-step parity of Inductor-compiled captured steps against eager torch.optim, state updated in place.

Every parameter, buffer and optimizer-state tensor is compared after 20 steps, and the loss at each.
Each model is paired with one optimizer (plus row-wise Adagrad on the tables) so that SGD-momentum,
Adam, AdamW and Adagrad and the four reference models are covered with five Inductor compiles (each
is 5-30 s on 2 shared cores) instead of sixteen.
Tolerances (rtol=1e-4, atol=1e-5): Inductor's C++ kernels vectorise and reorder float32 reductions
(matmul epilogues, LayerNorm/BatchNorm statistics, loss means) and fuse the optimizer arithmetic, so
each step differs from ATen by a few ulps; over 20 steps the drift stays around 1e-6, while a wrong
lowering (a missed term, a stale running statistic, a lost in-place write) is off by >1e-3 at once.
"""

from __future__ import annotations

import logging

import pytest
import recir.lower_gpu as lg
import torch
from recir.capture import capture_train_step, testing

RTOL, ATOL = 1e-4, 1e-5
STEPS = 20
# (model, optimizer, sparse_updates, embedding_backend). Dense torch.optim maths needs
# sparse_updates=False for a table whose optimizer is not row-wise exact (Adagrad with weight decay
# decays untouched rows too); RowWiseAdagrad is exact with sparse row-wise updates. The fbgemm case
# keeps the lookups as recir::fbgemm_embedding_bag override ops that Inductor calls as fallback
# kernels at graph boundaries (fbgemm-gpu-cpu's kernels here); in_graph inlines plain ATen.
CASES = [
    ("mlp", "adam", True, None),
    ("transformer", "adamw_amsgrad", True, None),
    ("batchnorm", "sgd_momentum_wd", True, None),
    ("embedding_bag", "adagrad", False, "fbgemm"),
    ("embedding_bag", "rowwise_adagrad", True, "in_graph"),
]
# The newest/oldest sessions' subset: a transformer through Inductor and FBGEMM's kernels as fallbacks.
SMOKE = {("transformer", "adamw_amsgrad"), ("embedding_bag", "adagrad")}


@pytest.mark.parametrize(
    ("case_name", "opt_name", "sparse_updates", "backend"),
    [pytest.param(*c, marks=pytest.mark.smoke) if c[:2] in SMOKE else c for c in CASES],
)
def test_compiled_step_matches_eager_for_20_steps_in_place(
    case_name, opt_name, sparse_updates, backend, lower_gpu_cache_dir
):
    if backend == "fbgemm":
        pytest.importorskip("fbgemm_gpu")  # recir-embedding[fbgemm-cpu]: absent in the standalone session
    case = testing.REFERENCE_CASES[case_name]
    model = case.build(seed=0)
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    ref, ref_opt = testing.clone_pair(model, opt_name)
    step = capture_train_step(model, optimizer, case.loss_fn, case.make_batch(0), overrides=case.overrides())
    opts = lg.GPUOptions(sparse_updates=sparse_updates, cache_dir=lower_gpu_cache_dir)
    compiled = lg.compile(step, device="cpu", embedding_backend=backend, options=opts)
    if case_name == "embedding_bag":
        assert compiled.embedding_backend == backend
        opaque = [n for n in compiled.step.graph.nodes if str(n.target).startswith("recir.fbgemm_")]
        assert bool(opaque) == (backend == "fbgemm")
        sparsified = compiled.step.meta["recir.embedding"].get("sparsify", {}).get("sparsified", [])
        assert bool(sparsified) == sparse_updates, compiled.step.meta["recir.embedding"]
    state = compiled.init_state(model, optimizer)
    ptrs = [t.data_ptr() for t in state]

    for i in range(STEPS):
        batch = case.make_batch(i)
        state, outputs = compiled(state, batch)
        assert [t.data_ptr() for t in state] == ptrs, f"state storage moved at step {i}"
        ref_loss = testing.eager_step(ref, ref_opt, case.loss_fn, batch)
        torch.testing.assert_close(outputs[0], ref_loss, rtol=RTOL, atol=ATOL)

    got = compiled.state_dict(state)
    eager = testing.eager_state_dict(ref, ref_opt)
    missing = sorted(set(eager) - set(got))
    assert not missing, f"slots missing from the compiled state: {missing}"
    bad = testing.state_mismatches(got, eager, rtol=RTOL, atol=ATOL)
    assert not bad, f"after {STEPS} steps these slots differ (max abs error): {bad}"


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize(
    ("opt_name", "sparse_updates"),
    # Dense Adam maths only without sparse updates (lazy Adam leaves untouched rows' moments alone);
    # RowWiseAdagrad is exact with them, so the sparse row-wise step is replayed by the graph too.
    [("adam", False), ("rowwise_adagrad", True)],
)
def test_cuda_parity_in_place_with_and_without_cuda_graphs(
    cuda_graphs, opt_name, sparse_updates, lower_gpu_cache_dir, caplog
):
    case = testing.REFERENCE_CASES["embedding_bag"]
    model = case.build(seed=0).cuda()
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    ref, ref_opt = testing.clone_pair(model, opt_name)
    example = {k: v.cuda() for k, v in case.make_batch(0).items()}
    step = capture_train_step(model, optimizer, case.loss_fn, example, overrides=case.overrides())
    # fused_tbe=False: the default fbgemm backend on CUDA keeps the tables in this one compiled graph
    # (test_lower_gpu_fused_tbe covers FBGEMM's fused TBE outside it)
    opts = lg.GPUOptions(
        cuda_graphs=cuda_graphs, sparse_updates=sparse_updates, cache_dir=lower_gpu_cache_dir, fused_tbe=False
    )
    compiled = lg.compile(step, device="cuda", options=opts)
    assert compiled.device.type == "cuda"
    sparsified = compiled.step.meta["recir.embedding"].get("sparsify", {}).get("sparsified", [])
    assert bool(sparsified) == sparse_updates, compiled.step.meta["recir.embedding"]
    state = compiled.init_state(model, optimizer)
    ptrs = [t.data_ptr() for t in state]
    with caplog.at_level(logging.INFO, logger="recir.lower_gpu"):
        for i in range(STEPS):
            batch = {k: v.cuda() for k, v in case.make_batch(i).items()}
            state, outputs = compiled(state, batch)
            ref_loss = testing.eager_step(ref, ref_opt, case.loss_fn, batch)
            torch.testing.assert_close(outputs[0], ref_loss, rtol=RTOL, atol=ATOL)
    # A capture failure falls back to running without graphs and only logs a warning: fail on it here.
    assert "CUDA graph capture failed" not in caplog.text
    graphs = compiled._cuda_graph
    if cuda_graphs:
        assert "captured the step as one CUDA graph" in caplog.text
        assert graphs is not None and graphs.disabled_reason is None and graphs._graph is not None
    else:
        assert graphs is None and "CUDA graph" not in caplog.text
    assert [t.data_ptr() for t in state] == ptrs
    bad = testing.state_mismatches(
        compiled.state_dict(state), testing.eager_state_dict(ref, ref_opt), rtol=RTOL, atol=ATOL
    )
    assert not bad, bad
