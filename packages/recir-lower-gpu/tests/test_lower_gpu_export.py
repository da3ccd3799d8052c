"""GPU-path export: a serving graph (to_inference) as an AOTInductor package plus manifest, loaded and
run in a process where no recir module can be imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import recir.lower_gpu as lg
import torch
from recir.capture import capture_train_step, testing
from recir.embedding import QuantizeTables
from recir.transforms import ConfigError, StepGraph, to_inference

_CHILD = r"""
import sys
sys.modules["recir"] = None  # torch alone (and FBGEMM when the package calls its kernels)
if sys.argv[3:] == ["fbgemm"]:
    import fbgemm_gpu
import torch
import torch._inductor.codecache  # torch 2.10's aoti_load_package uses it without importing it
path, inputs = sys.argv[1], sys.argv[2]
data = torch.load(inputs)
model = torch._inductor.aoti_load_package(path)
out = model(*data["state"], *data["batch"])
torch.save(out[-1], inputs + ".out")
print(any(m == "recir" or m.startswith("recir.") for m in sys.modules if sys.modules[m] is not None))
"""


def _serving() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor], StepGraph]:
    """The test model, its optimizer, a batch and its serving graph (the logits, no dropout)."""
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


def test_exported_package_runs_with_torch_alone(tmp_path, lower_gpu_cache_dir, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", lower_gpu_cache_dir)
    model, opt, batch, serving = _serving()
    import os

    from torch._inductor import config as inductor_config

    before = (inductor_config.save_config(), os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    manifest = lg.export(serving, tmp_path / "model.pt2", device="cpu")
    # AOTInductor's global writes are undone (else later compiles in this process miss the FX graph cache)
    assert (inductor_config.save_config(), os.environ.get("TORCHINDUCTOR_CACHE_DIR")) == before
    assert json.loads((tmp_path / "model.pt2.json").read_text()) == manifest
    assert manifest["outputs"] == [{"name": "aux.0", "shape": [2, 2], "dtype": "float32"}]

    state = serving.init_state(model, opt)
    _, (expected,) = serving(state, batch)
    torch.save(
        {"state": list(state), "batch": serving.signature.flatten_batch(batch)}, tmp_path / "inputs.pt"
    )
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "model.pt2"), str(tmp_path / "inputs.pt")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"  # no recir module was loaded
    torch.testing.assert_close(torch.load(tmp_path / "inputs.pt.out"), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,baked", [("int8", True), ("fp16", False)], ids=["int8-baked", "fp16-inputs"])
def test_quantised_serving_graph_exports_with_baked_or_input_state(
    tmp_path, lower_gpu_cache_dir, monkeypatch, dtype, baked
):
    """Quantised tables (recir-embed-quantize-tables) are plain ATen: the package still runs with torch
    alone, the tables either compiled in as constants (``baked_state``) or passed as inputs."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", lower_gpu_cache_dir)
    model, opt, batch, serving = _serving()
    quantized = QuantizeTables(dtype=dtype)(serving).step
    state = quantized.init_state(model, opt)
    float_state = serving.init_state(model, opt)  # the float table where the quantised one belongs
    float_state += [torch.zeros(2)] * (len(state) - len(float_state))
    with pytest.raises(
        ConfigError, match=r"state slot 'param:emb.weight_(int8|fp16)' is (uint8|float16)\[20, 4\]"
    ):
        lg.export(quantized, tmp_path / "bad.pt2", device="cpu", baked_state=float_state)
    manifest = lg.export(
        quantized, tmp_path / "model.pt2", device="cpu", baked_state=state if baked else None
    )
    specs = manifest["baked_state" if baked else "state"]
    assert manifest["state" if baked else "baked_state"] == []
    table = {"int8": [("param:emb.weight_int8", "uint8"), ("param:emb.weight_qscale", "float32"),
                      ("param:emb.weight_qbias", "float32")], "fp16": [("param:emb.weight_fp16", "float16")]}[dtype]  # fmt: skip
    assert [(s["name"], s["dtype"]) for s in specs[: len(table)]] == table
    assert manifest["meta"]["recir.quantize"]["dtype"] == dtype
    assert ("(*batch) -> (*outputs)" in manifest["format"]) == baked

    _, (expected,) = quantized(state, batch)
    inputs = {"state": [] if baked else list(state), "batch": quantized.signature.flatten_batch(batch)}
    torch.save(inputs, tmp_path / "inputs.pt")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "model.pt2"), str(tmp_path / "inputs.pt")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"  # no recir module was loaded
    torch.testing.assert_close(torch.load(tmp_path / "inputs.pt.out"), expected, rtol=1e-5, atol=1e-6)


def test_fbgemm_quantised_tables_export_calls_fbgemms_inference_tbe(
    tmp_path, lower_gpu_cache_dir, monkeypatch
):
    """``QuantizeTables(kernel="fbgemm")``: the package calls FBGEMM's inference TBE (it loads after
    ``import fbgemm_gpu`` and not without it), RecIR still not importable, and gives the reference's values."""
    pytest.importorskip("fbgemm_gpu")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", lower_gpu_cache_dir)
    model, opt, batch, serving = _serving()
    quantized = QuantizeTables(dtype="int8", kernel="fbgemm")(serving).step
    state = quantized.init_state(model, opt)
    manifest = lg.export(quantized, tmp_path / "model.pt2", device="cpu")
    assert manifest["requires"] == ["fbgemm_gpu"] and "fbgemm_gpu" in manifest["versions"]
    assert "import fbgemm_gpu" in manifest["format"]
    assert manifest["state"][0] == {
        "name": "param:emb.weight_fbgemm_int8",
        "shape": [20, 16],
        "dtype": "uint8",
    }
    _, (expected,) = quantized(state, batch)
    torch.save(
        {"state": list(state), "batch": quantized.signature.flatten_batch(batch)}, tmp_path / "inputs.pt"
    )
    run = [sys.executable, "-c", _CHILD, str(tmp_path / "model.pt2"), str(tmp_path / "inputs.pt")]
    out = subprocess.run([*run, "fbgemm"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"  # no recir module was loaded
    torch.testing.assert_close(torch.load(tmp_path / "inputs.pt.out"), expected, rtol=1e-6, atol=1e-6)
    without = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert without.returncode != 0
    assert "fbgemm::int_nbit_split_embedding_codegen_lookup_function" in without.stderr


def test_cpu_packages_add_the_bias_after_the_product(tmp_path):
    """On the CPU, `package` has AOTInductor compute each `linear`/`addmm` as a product then a bias add
    (ATen's CPU addmm copies the broadcast bias into its output first; the add fuses into Inductor's next
    kernel), also for 2-d inputs, whose `mm` + add Inductor's own patterns fold back into addmm: the
    generated code calls no addmm, and the values are the model's."""
    import zipfile

    from recir.lower_gpu import package
    from recir.lower_gpu._export import UnfuseCpuAddmm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    for name, x in (("rows", torch.randn(5, 8)), ("batched", torch.randn(3, 5, 8))):
        path = package(torch.export.export(model, (x,)).run_decompositions(), tmp_path / f"{name}.pt2")
        with zipfile.ZipFile(path) as z:
            code = "".join(z.read(f).decode() for f in z.namelist() if f.endswith(".cpp"))
            # the archive's entries are named after the package, not the temporary file it was written as
            assert {f.split("/")[0] for f in z.namelist()} == {name}, z.namelist()[:3]
        assert "cpu_mm_out" in code and "cpu_addmm_out" not in code, name
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"rows.pt2", f"{name}.pt2"}), name
        got = torch._inductor.aoti_load_package(str(path))(x)
        torch.testing.assert_close(got, model(x), rtol=0, atol=1e-6)
    # addmm's beta=0 ignores its bias (even NaN); alpha scales the product
    a, b, bias = torch.randn(4, 3), torch.randn(3, 2), torch.full((2,), float("nan"))
    gm = torch.fx.symbolic_trace(lambda bias, a, b: torch.ops.aten.addmm.default(bias, a, b, beta=0, alpha=2))
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["val"] = torch.empty(4, 2)
    UnfuseCpuAddmm()(gm.graph)
    gm.recompile()
    assert torch.ops.aten.addmm.default not in {n.target for n in gm.graph.nodes}
    torch.testing.assert_close(gm(bias, a, b), 2 * a @ b)


@pytest.mark.parametrize("cpu_matmul", ["auto", "aten"])
def test_cpu_packages_run_float32_products_through_onednn(tmp_path, cpu_matmul):
    """On the CPU, `package` runs each float32 product of at least MIN_MACS multiply-adds as oneDNN's
    linear (`mkldnn._linear_pointwise`, torch's own op: the package still loads with torch alone), smaller
    ones as ATen's mm; `cpu_matmul="aten"` keeps ATen's mm for all. Values: the model's."""
    import zipfile

    from recir.lower_gpu._onednn import MIN_MACS

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.SiLU(), torch.nn.Linear(256, 64), torch.nn.Linear(64, 2)
    ).eval()
    x = torch.randn(4096, 64)
    assert 4096 * 64 * 256 >= MIN_MACS > 4096 * 64 * 2  # two large products, one small
    program = torch.export.export(model, (x,)).run_decompositions()
    path = lg.package(program, tmp_path / "mlp.pt2", cpu_matmul=cpu_matmul)
    with zipfile.ZipFile(path) as z:
        code = "".join(z.read(f).decode() for f in z.namelist() if f.endswith(".cpp"))
    assert code.count("aoti_torch_cpu__linear_pointwise(") == (2 if cpu_matmul == "auto" else 0)
    assert code.count("aoti_torch_cpu_mm_out(") == (1 if cpu_matmul == "auto" else 3)
    torch.save({"state": [], "batch": [x]}, tmp_path / "inputs.pt")
    child = [sys.executable, "-c", _CHILD, str(path), str(tmp_path / "inputs.pt")]
    out = subprocess.run(child, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("False")  # no recir module was imported
    # the package returns the model's tensor, of which the child saved `out[-1]`: the last row
    torch.testing.assert_close(torch.load(tmp_path / "inputs.pt.out"), model(x)[-1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        torch._inductor.aoti_load_package(str(path))(x), model(x), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="cpu_matmul must be 'auto', 'onednn' or 'aten', got 'mkl'"):
        lg.package(program, tmp_path / "bad.pt2", cpu_matmul="mkl")  # type: ignore[arg-type]
