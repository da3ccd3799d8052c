"""The TPU lowering's rewrites are a Pipeline of registered Transforms (``tpu_pipeline``):
``compiled.pipeline.report()`` lists them from capture's output to torchax's input."""

from __future__ import annotations

from recir.capture import capture_train_step, testing
from recir.lower_tpu import compile

CASE = testing.REFERENCE_CASES["embedding_bag"]


def test_report_lists_every_rewrite_on_both_backends(tmp_path, monkeypatch):
    model = CASE.build(seed=0)
    opt = testing.make_optimizer("rowwise_adagrad", model.parameters())
    step = capture_train_step(model, opt, CASE.loss_fn, CASE.make_batch(0), overrides=CASE.overrides())
    monkeypatch.setenv("RECIR_DUMP_DIR", str(tmp_path))
    compiled = compile(step)
    assert [r.name for r in compiled.pipeline.records] == [
        "recir-embed-sparsify-update",
        "recir-embed-apply-backend",
    ]
    assert "recir-embed-apply-backend" in compiled.pipeline.report()
    # the last dump is what torchax traces: the compiled step's own graph
    last = sorted(tmp_path.glob("*.after.txt"))[-1].read_text()
    assert last.endswith(compiled.step.format_graph(vals=True) + "\n")
    host = compile(step, embedding_backend="cpu")
    assert [r.name for r in host.pipeline.records] == [
        "recir-embed-sparsify-update",
        "recir-embed-split-host",
        "recir-embed-apply-backend",
        "recir-embed-cut-host-split",
    ]
    assert host.pipeline is host.device.pipeline
