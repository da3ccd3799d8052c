"""The TPU lowering's rewrites are a Pipeline of registered Transforms (``tpu_pipeline``):
``compiled.pipeline.report()`` lists them from capture's output to torchax's input."""

from __future__ import annotations

import jax
import torch
from recir.capture import capture_train_step, testing
from recir.lower_tpu import TPUOptions, compile
from recir.transforms import to_inference

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
        "recir-split-concat-products",  # JAX's CPU backend (nothing to split here)
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
        "recir-split-concat-products",
    ]
    assert host.pipeline is host.device.pipeline


class _ConcatProjection(torch.nn.Module):
    """x + W concat[u, silu(a), u * a] (HSTU's output projection), and a loss on it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 2)
        self.out = torch.nn.Linear(9, 2)

    def forward(self, x, y):
        u, a = torch.nn.functional.silu(x[..., 3:]), x[..., :3]
        pred = self.proj(x) + self.out(torch.cat([u, torch.nn.functional.silu(a), u * a], dim=-1))
        return ((pred - y) ** 2).mean(), pred


def test_products_of_concatenations_are_split_on_the_cpu_backend_with_the_same_values():
    torch.manual_seed(0)
    model = _ConcatProjection()
    batch = {"x": torch.randn(4, 5, 6), "y": torch.randn(4, 5, 2)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, lambda m, b: m(b["x"], b["y"]), batch)
    serving = to_inference(step)
    results = {}
    for split in (None, False):
        compiled = compile(serving, options=TPUOptions(split_concat_products=split))
        records = {r.name: r for r in compiled.pipeline.records}
        if split is None and jax.default_backend() == "cpu":  # the default: on for JAX's CPU backend
            assert records["recir-split-concat-products"].stats == {"split": 1}
        if split is False:
            assert "recir-split-concat-products" not in records
        _, pred = compiled(compiled.init_state(model, opt), batch)
        results[split] = pred[0] if isinstance(pred, (list, tuple)) else pred
    with torch.no_grad():
        want = model(batch["x"], batch["y"])[1]
    torch.testing.assert_close(results[None], results[False], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(results[None], want, rtol=1e-5, atol=1e-5)
