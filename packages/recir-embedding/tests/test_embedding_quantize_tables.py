"""recir-embed-quantize-tables: serving graphs whose tables are stored int8 (row-wise scale and bias, as
FBGEMM) or fp16; each lookup gathers quantised rows, dequantises them and pools as before."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from recir.capture import capture_train_step, testing
from recir.embedding import (
    QTYPES,
    QUANTIZE_KEY,
    QuantizeTables,
    dequantize_rows,
    lower_quantized_lookups,
    overrides,
    pack_rows,
    packed_row_bytes,
    prepare_for_lowering,
    quantize_rows,
    quantized_lookup_reference,
    unpack_rows,
)
from recir.transforms import ConfigError, Pipeline, StepGraph, apply_overrides, to_inference, verify
from torch import nn


def _serving() -> tuple[nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor], StepGraph]:
    torch.manual_seed(0)
    model = testing.ServingModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batch = testing.serving_batch()
    return (
        model,
        opt,
        batch,
        to_inference(capture_train_step(model, opt, testing.serving_loss, batch), "aux.0"),
    )


def test_quantize_rows_is_fbgemms_8bit_rowwise_scheme() -> None:
    w = torch.randn(50, 16, generator=torch.Generator().manual_seed(0)) * 3
    q, scale, bias = quantize_rows(w, "int8")
    assert (q.dtype, scale.dtype, bias.dtype) == (torch.uint8, torch.float32, torch.float32)
    ids = torch.arange(50)
    err = (dequantize_rows((q, scale, bias), ids) - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())  # round to nearest: half a step per row
    (h,) = quantize_rows(w, "fp16")
    assert h.dtype == torch.float16 and torch.equal(dequantize_rows((h,), ids), w.half().float())
    with pytest.raises(ConfigError, match="dtype must be one of"):
        quantize_rows(w, "int4")
    pytest.importorskip("fbgemm_gpu")
    fused = torch.ops.fbgemm.FloatToFused8BitRowwiseQuantized(w)  # [R, D + 8]: bytes, then scale, bias
    assert torch.equal(fused[:, :16], q)
    assert torch.equal(fused[:, 16:].contiguous().view(torch.float32), torch.stack([scale, bias], 1))


def test_int8_graph_before_after_and_state() -> None:
    model, opt, batch, serving = _serving()
    result = QuantizeTables(dtype="int8")(serving)
    step = result.step
    verify(step, level=2)
    assert [s.name for s in serving.signature.state][0] == "param:emb.weight"  # the input is not modified
    assert [(s.name, s.dtype, s.shape) for s in step.signature.state[:3]] == [
        ("param:emb.weight_int8", torch.uint8, (20, 4)),
        ("param:emb.weight_qscale", torch.float32, (20,)),
        ("param:emb.weight_qbias", torch.float32, (20,)),
    ]
    text = step.format_graph().splitlines()
    lookup = [
        line for line in text[:-1] if "= input" not in line and "permute" not in line and "addmm" not in line
    ]
    assert "\n".join(lookup) == (
        "%view = aten.view(%ids, [-1])  # forward\n"
        "%index_select = aten.index_select(%param_emb_weight_int8, 0, %view)  # forward\n"
        "%_to_copy = aten._to_copy(%index_select, dtype=torch.float32)  # forward\n"
        "%index_select_1 = aten.index_select(%param_emb_weight_qscale, 0, %view)  # forward\n"
        "%unsqueeze = aten.unsqueeze(%index_select_1, 1)  # forward\n"
        "%mul = aten.mul.Tensor(%_to_copy, %unsqueeze)  # forward\n"
        "%index_select_2 = aten.index_select(%param_emb_weight_qbias, 0, %view)  # forward\n"
        "%unsqueeze_1 = aten.unsqueeze(%index_select_2, 1)  # forward\n"
        "%add = aten.add.Tensor(%mul, %unsqueeze_1)  # forward\n"
        "%arange = aten.arange(4, dtype=torch.int64, device=device(type='cpu'), pin_memory=False)  # forward\n"
        "%view_1 = aten.view(%arange, [4])  # forward\n"
        "%_embedding_bag_1 = aten._embedding_bag(%add, %view_1, %offsets)  # forward\n"
        "%getitem_1 = getitem(%_embedding_bag_1, 0)  # forward\n"
        "%cat = aten.cat([%getitem_1, %dense], 1)  # forward"
    )
    assert text[-1] == (
        "return [%param_emb_weight_int8, %param_emb_weight_qscale, %param_emb_weight_qbias, %param_fc_weight, "
        "%param_fc_bias, %addmm]"
    )
    assert result.changed and dict(result.stats) == {
        "matched": 1, "rewritten": 1, "tables": 1, "skipped": {}, "table_bytes": 320, "quantized_bytes": 240,
    }  # fmt: skip
    assert step.meta[QUANTIZE_KEY]["tables"] == {
        "param:emb.weight": ["param:emb.weight_int8", "param:emb.weight_qscale", "param:emb.weight_qbias"]
    }
    state = step.init_state(model, opt)  # quantises the live table
    q, scale, bias = quantize_rows(model.emb.weight, "int8")
    assert torch.equal(state[0], q) and torch.equal(state[1], scale) and torch.equal(state[2], bias)
    assert not QuantizeTables(dtype="int8")(step).changed  # nothing left to quantise


def _float_state_with_dequantised_tables(serving, quantized, state, dtype):
    """The float serving graph's state with each quantised table replaced by its dequantised values:
    the quantised graph must compute exactly that (only the rounding of the tables differs)."""
    names = serving.signature.state_names()
    out = list(state)
    for table in quantized.meta[QUANTIZE_KEY]["tables"]:
        i = names.index(table)
        parts = quantize_rows(state[i], dtype)
        out[i] = (
            parts[0].float() * parts[1][:, None] + parts[2][:, None] if dtype == "int8" else parts[0].float()
        )
    return out


def _embedding_bag_case():
    case = testing.REFERENCE_CASES["embedding_bag"]  # recir::embedding_bag: sum + weights, mean over 2-D ids
    model = case.build(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = case.make_batch(0)
    step = capture_train_step(model, opt, case.loss_fn, batch, overrides=case.overrides())
    return model, opt, batch, to_inference(step, 0), 2


def _torchrec_case(helpers):
    pytest.importorskip("torchrec")
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())  # recir::embedding_bag and recir::embedding
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch, _ = helpers.random_batch(torch.Generator().manual_seed(1))
    step = capture_train_step(model, opt, helpers.loss_fn, batch)
    return model, opt, batch, to_inference(step, 0), 3


@pytest.mark.parametrize("dtype", ["int8", "fp16"])
@pytest.mark.parametrize("case", ["aten_embedding_bag", "recir_embedding_bag", "torchrec"])
def test_quantised_graph_computes_the_float_graph_on_dequantised_tables(case, dtype, helpers) -> None:
    if case == "aten_embedding_bag":
        model, opt, batch, serving = _serving()
        tables = 1
    elif case == "recir_embedding_bag":
        model, opt, batch, serving, tables = _embedding_bag_case()
    else:
        model, opt, batch, serving, tables = _torchrec_case(helpers)
    pipeline = Pipeline([QuantizeTables(dtype=dtype)], verify_level=2)
    quantized = pipeline.run(serving)
    assert pipeline.records[-1].stats["rewritten"] >= tables == pipeline.records[-1].stats["tables"]
    state = serving.init_state(model, opt)
    _, (want,) = serving(_float_state_with_dequantised_tables(serving, quantized, state, dtype), batch)
    _, (got,) = quantized(quantized.init_state(model, opt), batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    _, (exact,) = serving(state, batch)
    assert not torch.equal(got, exact)  # the tables did change: rounding shows in the output


class _Tied(nn.Module):
    """A table that is also the output projection (weight tying): not only a lookup reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids).sum(0) @ self.emb.weight.t()


def test_preconditions_and_skipped_tables() -> None:
    model, opt, batch, serving = _serving()
    step = capture_train_step(model, opt, testing.serving_loss, batch)
    with pytest.raises(ConfigError, match=r"training step .* Fix: quantise the serving graph"):
        QuantizeTables()(step)
    with pytest.raises(
        ConfigError, match=r"\['param:fc.weight'\] are not embedding tables .* \['param:emb.weight'\]"
    ):
        QuantizeTables(tables=("param:fc.weight",))(serving)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        QuantizeTables(dtype="int4")

    tied = _Tied()
    tied_opt = torch.optim.SGD(tied.parameters(), lr=0.1)
    ids = torch.tensor([1, 2, 3])
    tied_step = capture_train_step(tied, tied_opt, lambda m, b: (m(b).sum(), m(b)), ids)
    result = QuantizeTables()(to_inference(tied_step, 1))
    assert not result.changed
    assert "reads the table, not a lookup" in result.stats["skipped"]["param:emb.weight"]


# -- kernel="fbgemm": FBGEMM's inference-TBE rows, read by recir::quantized_lookup ------------------------
@pytest.mark.parametrize("dtype", ["int8", "fp16"])
def test_packed_rows_are_fbgemms_inference_tbe_rows(dtype: str) -> None:
    """``pack_rows`` writes what FBGEMM's inference TBE reads: its kernel and the ATen reference agree on
    every pooling (none, sum, mean, weighted sum; an empty bag), and the rows are within half a step."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g) * 3
    w[3] = 1.5  # a constant row: scale 0
    packed = pack_rows(w, dtype)
    assert packed.dtype == torch.uint8 and packed.shape == (40, packed_row_bytes(24, dtype))
    assert packed.shape[1] % 16 == 0 and packed_row_bytes(24, dtype) == (32 if dtype == "int8" else 48)
    rows = unpack_rows(packed, 24, dtype)
    if dtype == "int8":  # fp16 scale and bias, q rounded against them: half a step, plus their rounding
        scale = packed[:, :2].contiguous().view(torch.float16).float()
        bound = scale / 2 + (w.abs().amax(1, keepdim=True) + 255 * scale) * 2**-11
        assert bool(((rows - w).abs() <= bound).all())
        assert torch.equal(rows[3], torch.full((24,), 1.5))
    else:
        assert torch.equal(rows, w.half().float())
    with pytest.raises(ConfigError, match="dtype must be one of"):
        pack_rows(w, "int4")
    pytest.importorskip("fbgemm_gpu")
    from recir.embedding._quantized_lookup import fbgemm_lookup

    ids = torch.randint(0, 40, (30,), generator=g)
    offsets = torch.tensor([0, 4, 4, 17, 30])
    psw = torch.rand(30, generator=g)
    for pooling, weights in ((2, None), (0, None), (1, None), (0, psw)):
        offs = torch.arange(31) if pooling == 2 else offsets
        ref = quantized_lookup_reference(packed, ids, offs, weights, pooling, 24, QTYPES[dtype])
        assert ref.shape == ((30, 24) if pooling == 2 else (4, 24))
        got = fbgemm_lookup(packed, ids, offs, weights, pooling, 24, QTYPES[dtype])
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_fbgemm_kernel_stores_packed_rows_and_lowers_to_fbgemm() -> None:
    model, opt, batch, serving = _serving()
    result = QuantizeTables(dtype="int8", kernel="fbgemm")(serving)
    step = result.step
    verify(step, level=2)
    assert [(s.name, s.dtype, s.shape) for s in step.signature.state[:2]] == [
        ("param:emb.weight_fbgemm_int8", torch.uint8, (20, 16)),
        ("param:fc.weight", torch.float32, (2, 7)),
    ]
    assert step.meta[QUANTIZE_KEY]["kernel"] == "fbgemm"
    (lookup,) = [n for n in step.graph.nodes if n.target is torch.ops.recir.quantized_lookup.default]
    assert lookup.meta["recir.override"] == "recir-embed-quantized-lookup"
    state = step.init_state(model, opt)
    assert torch.equal(state[0], pack_rows(model.emb.weight, "int8"))
    _, (got,) = step(state, batch)
    _, (exact,) = serving(serving.init_state(model, opt), batch)
    assert 0 < float((got - exact).abs().max()) < 2e-2  # quantised, not float

    def lookups(s: StepGraph) -> int:
        return sum(n.target is torch.ops.recir.quantized_lookup.default for n in s.graph.nodes)

    # the lowerings inline the ATen reference (the TPU path through torchax), unless asked to keep it
    inlined = prepare_for_lowering(step, backend="in_graph", target="tpu")
    assert lookups(inlined) == 0
    _, (same,) = inlined(state, batch)
    torch.testing.assert_close(same, got, rtol=0, atol=0)
    kept = prepare_for_lowering(
        step, backend="in_graph", target="gpu", device="cpu", sparse_updates=False, keep_checks=False,
        keep_quantized=True,
    )  # fmt: skip
    assert lookups(kept) == 1
    pytest.importorskip("fbgemm_gpu")
    gm = fx.GraphModule(kept.graph_module, copy.deepcopy(kept.graph))
    assert lower_quantized_lookups(gm, "cpu") == 1
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert "fbgemm.int_nbit_split_embedding_codegen_lookup_function.default" in targets
    out = gm(*state, *kept.signature.flatten_batch(batch))
    torch.testing.assert_close(out[-1], got, rtol=1e-6, atol=1e-6)


def test_fbgemm_kernel_falls_back_to_unpacked_rows_for_max_pooling() -> None:
    """FBGEMM's inference TBE has no max pooling: such a bag unpacks the gathered rows and pools in ATen."""
    model, opt, batch, _ = _serving()
    model.emb.mode = "max"
    serving = to_inference(capture_train_step(model, opt, testing.serving_loss, batch), "aux.0")
    step = QuantizeTables(dtype="fp16", kernel="fbgemm")(serving).step
    verify(step, level=2)
    assert not any(n.target is torch.ops.recir.quantized_lookup.default for n in step.graph.nodes)
    assert step.signature.state[0].name == "param:emb.weight_fbgemm_fp16"
    _, (got,) = step(step.init_state(model, opt), batch)
    half = copy.deepcopy(model)
    half.emb.weight.data = half.emb.weight.data.half().float()
    _, (want,) = serving(serving.init_state(half, opt), batch)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match="kernel must be one of"):
        QuantizeTables(dtype="int8", kernel="int4")  # type: ignore[arg-type]
