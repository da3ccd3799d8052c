"""The GPU lowering is a Pipeline of registered Transforms (``recir.lower_gpu._pipeline.gpu_pipeline``):
``compiled.pipeline.report()`` lists every rewrite from capture's output to Inductor's input, each can be
disabled by name (``RECIR_DISABLE``) and ``RECIR_DUMP_DIR`` holds the graph Inductor received."""

from __future__ import annotations

import pytest
import recir.lower_gpu as lg
import torch
from recir.capture import capture_train_step, testing

CASE = testing.REFERENCE_CASES["embedding_bag"]
IN_GRAPH = [
    "recir-gpu-distribute-step",
    "recir-embed-sparsify-update",
    "recir-embed-apply-backend",
    "recir-gpu-store-shared-masks",
    "recir-gpu-retarget-devices",
    "recir-gpu-onednn-matmul",
    "recir-gpu-check-kernels",
    "recir-gpu-in-place-epilogue",
]


def _step():  # type: ignore[no-untyped-def]
    model = CASE.build(seed=0)
    opt = testing.make_optimizer("rowwise_adagrad", model.parameters())
    return (
        model,
        opt,
        capture_train_step(model, opt, CASE.loss_fn, CASE.make_batch(0), overrides=CASE.overrides()),
    )


def _names(compiled) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.name for r in compiled.pipeline.records]


def test_report_lists_every_rewrite_and_the_dump_holds_inductors_input(
    lower_gpu_cache_dir, tmp_path, monkeypatch
):
    model, opt, step = _step()
    monkeypatch.setenv("RECIR_DUMP_DIR", str(tmp_path))
    compiled = lg.compile(
        step, device="cpu", embedding_backend="in_graph", options=lg.GPUOptions(cache_dir=lower_gpu_cache_dir)
    )
    assert _names(compiled) == IN_GRAPH
    report = compiled.pipeline.report()
    assert all(name in report for name in IN_GRAPH) and "copies=" in report
    # the last dump is the in-place epilogue's output: the graph compile_fx received
    last = sorted(tmp_path.glob("*.after.txt"))[-1]
    assert last.name.endswith("recir-gpu-in-place-epilogue.after.txt")
    assert "aten.copy_" in last.read_text()
    # compiled.step is the last valid StepGraph (before the epilogue)
    assert not any(n.target is torch.ops.aten.copy_.default for n in compiled.step.graph.nodes)

    # the fused FBGEMM TBE path: the cut at the embedding boundary is a transform too
    pytest.importorskip("fbgemm_gpu")  # recir-embedding[fbgemm-cpu]: absent in the standalone session
    fused = lg.compile(
        step, device="cpu", embedding_backend="fbgemm", options=lg.GPUOptions(cache_dir=lower_gpu_cache_dir)
    )
    assert _names(fused) == [
        "recir-gpu-distribute-step",
        "recir-embed-sparsify-update",
        "recir-embed-split-host",
        "recir-embed-apply-backend",
        "recir-embed-cut-host-split",
        "recir-gpu-store-shared-masks",
        "recir-gpu-retarget-devices",
        "recir-gpu-onednn-matmul",
        "recir-gpu-check-kernels",
        "recir-gpu-in-place-epilogue",
    ]


def test_each_rewrite_can_be_disabled_by_name(lower_gpu_cache_dir, monkeypatch):
    # bisecting a miscompile: without the in-place epilogue the step returns fresh state, same numbers
    model, opt, step = _step()
    options = lg.GPUOptions(cache_dir=lower_gpu_cache_dir)
    ref = lg.compile(step, device="cpu", embedding_backend="in_graph", options=options)
    monkeypatch.setenv("RECIR_DISABLE", "recir-gpu-in-place-epilogue,recir-embed-sparsify-update")
    bisect = lg.compile(step, device="cpu", embedding_backend="in_graph", options=options)
    status = {r.name: r.status for r in bisect.pipeline.records}
    assert status["recir-gpu-in-place-epilogue"] == status["recir-embed-sparsify-update"] == "disabled"
    assert not bisect.in_place
    a, b = ref.init_state(model, opt), bisect.init_state(model, opt)
    for i in range(3):
        a, out_a = ref(a, CASE.make_batch(i))
        b, out_b = bisect(b, CASE.make_batch(i))
        torch.testing.assert_close(out_b[0], out_a[0], rtol=1e-5, atol=1e-6)
    for name, value in ref.state_dict(a).items():
        torch.testing.assert_close(bisect.state_dict(b)[name], value, rtol=1e-5, atol=1e-6, msg=name)
