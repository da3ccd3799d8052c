"""`--precision bf16`: recir-mixed-precision on the captured step (bf16 products, fp32 master weights and
optimizer state), torch.autocast on eager; the default debug run keeps fp32's AUC."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from recir.dlrmv3 import TrainOptions, train
from recir.dlrmv3._cli import main
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer
from recir.transforms import ConfigError

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)


def _trainer(precision: str, target: str = "eager-graph"):  # type: ignore[no-untyped-def]
    opts = TrainOptions(**TINY, target=target, precision=precision)
    model, data, optimizers = build(opts)
    return make_trainer(target, model, optimizers, data.train_batch(0), precision=precision), data


def test_dlrmv3_bf16_rewrites_every_product_and_keeps_fp32_state():
    bf16, data = _trainer("bf16")
    fp32, _ = _trainer("fp32")
    products = [n for n in bf16.graph.graph.nodes if n.target in _MATMULS]
    assert products and all(n.meta["val"].dtype == torch.bfloat16 for n in products)
    assert all(n.meta["val"].dtype == torch.float32 for n in fp32.graph.graph.nodes if n.target in _MATMULS)
    assert all(s.dtype != torch.bfloat16 for s in bf16.graph.signature.state)  # master weights stay fp32
    for step in range(3):
        loss_b, _ = bf16.step(data.train_batch(step))
        loss_f, _ = fp32.step(data.train_batch(step))
        assert abs(float(loss_b) - float(loss_f)) < 2e-2 * abs(float(loss_f)) + 1e-3
    state_b, state_f = bf16.state_dict(), fp32.state_dict()
    assert state_b.keys() == state_f.keys()
    for name, value in state_b.items():
        assert value.dtype == state_f[name].dtype, name
    moved = [n for n in state_b if n.startswith("param:") and not torch.equal(state_b[n], state_f[n])]
    assert moved  # bf16 products change the low bits of the updates


def test_dlrmv3_eager_bf16_is_autocast():
    trainer, data = _trainer("bf16", target="eager")
    assert trainer.autocast
    loss, logits = trainer.step(data.train_batch(0))
    assert torch.isfinite(loss) and logits.dtype == torch.bfloat16  # the head's Linear ran under autocast
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_dlrmv3_bad_precision(capsys):
    with pytest.raises(ConfigError, match="--precision 'fp8'"):
        TrainOptions(precision="fp8").check()
    with pytest.raises(SystemExit) as info:
        main(["train", "--precision", "fp8"])
    assert info.value.code == 2 and "--precision" in capsys.readouterr().err


def test_dlrmv3_matmul_precision_sets_torch_and_reaches_the_tpu_step(capsys):
    """--matmul_precision sets torch's float32 product precision for the run; the TPU path's step follows it
    (float32 products at `high`: three bf16 passes on a TPU, the CPU backend's float32 unchanged)."""
    # set_float32_matmul_precision("highest") leaves the backends' fp32_precision at "ieee", not the
    # default "none": a state Inductor's cache key reads, so restore those flags themselves
    knobs = [
        m for m in (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul) if hasattr(m, "fp32_precision")
    ]
    before, flags = torch.get_float32_matmul_precision(), [m.fp32_precision for m in knobs]
    try:
        opts = TrainOptions(**TINY, target="tpu", matmul_precision="high")
        model, data, optimizers = build(opts)
        assert torch.get_float32_matmul_precision() == "high"
        trainer = make_trainer("tpu", model, optimizers, data.train_batch(0))
        assert trainer.compiled.matmul_precision == "high"  # type: ignore[attr-defined]
        assert torch.isfinite(trainer.step(data.train_batch(0))[0])
    finally:
        torch.set_float32_matmul_precision(before)
        for m, value in zip(knobs, flags):
            m.fp32_precision = value
    assert torch.get_float32_matmul_precision() == before
    with pytest.raises(ConfigError, match="--matmul_precision 'tf32'.*highest, high, medium"):
        TrainOptions(matmul_precision="tf32").check()
    with pytest.raises(SystemExit) as info:
        main(["train", "--matmul_precision", "tf32"])
    assert info.value.code == 2 and "--matmul_precision" in capsys.readouterr().err


@pytest.mark.tpu
def test_dlrmv3_bf16_default_debug_run_keeps_fp32_auc():
    """The default `train` (debug dataset, 400 steps) on the TPU path: bf16 products' final AUC, and bf16
    tables' (`--table_dtype bf16`), each within 0.01 of fp32's."""
    opts = TrainOptions(target="tpu", num_threads=1, log_every=1000)
    fp32 = train(opts, log=lambda _: None)
    assert (
        fp32.metrics["vvp100/auc"] > 0.75
    )  # the debug data is learnable: a run that learns nothing cannot pass
    for change in ({"precision": "bf16"}, {"table_dtype": "bf16"}):
        low = train(dataclasses.replace(opts, **change), log=lambda _: None)
        auc_f, auc_b = fp32.metrics["vvp100/auc"], low.metrics["vvp100/auc"]
        assert abs(auc_b - auc_f) < 0.01, (change, auc_f, auc_b)
        assert fp32.losses != low.losses, change  # the run really ran other maths


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ("fpu avx2 avx512f avx512_bf16", True),
        ("fpu avx2 amx_bf16 amx_tile", True),
        ("fpu sse2 avx2 fma", False),
    ],
)
def test_cpu_bf16_units_are_read_from_the_cpu_flags(tmp_path, flags, expected):
    from recir.dlrmv3._train import cpu_has_bf16_units

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {flags}\n\n")
    assert cpu_has_bf16_units(str(info)) is expected
    assert cpu_has_bf16_units(str(tmp_path / "absent")) is None  # unreadable: nothing claimed


@pytest.mark.parametrize("units", [False, True, None])
def test_bf16_on_a_cpu_without_bf16_units_warns_with_the_fix(monkeypatch, caplog, units):
    import recir.dlrmv3._train as train_module

    monkeypatch.setattr(train_module, "cpu_has_bf16_units", lambda: units)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING", logger="recir.dlrmv3"):
        build(TrainOptions(**TINY, target="eager", precision="bf16"))
        build(TrainOptions(**TINY, target="eager", precision="fp32"))
    warned = [r.getMessage() for r in caplog.records if "bf16 units" in r.getMessage()]
    assert len(warned) == (1 if units is False else 0)
    if warned:
        assert "Fix: use --precision fp32" in warned[0]
