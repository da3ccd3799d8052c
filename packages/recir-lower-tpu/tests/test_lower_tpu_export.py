"""TPU-path export: a serving graph (to_inference) as a serialised jax.export artifact with a manifest,
loaded and run in a process where torch cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from recir.capture import capture_train_step, testing
from recir.embedding import QuantizeTables
from recir.lower_tpu import compile
from recir.transforms import ConfigError, to_inference

pytestmark = pytest.mark.tpu

_CHILD = r"""
import sys, json
sys.modules["torch"] = None  # only JAX (and numpy) here
import numpy as np
import jax
from jax import export
path, inputs = sys.argv[1], sys.argv[2]
exp = export.deserialize(bytearray(open(path, "rb").read()))
manifest = json.load(open(path + ".json"))
data = np.load(inputs)
state = [data[f"s{i}"] for i in range(len(manifest["state"]))]
batch = [data[f"b{i}"] for i in range(len(manifest["batch"]))]
outs = exp.call(batch) if manifest["baked_state"] else exp.call(state, batch)[1]
np.save(inputs + ".out.npy", np.asarray(outs[0]))
print("torch" in sys.modules and sys.modules["torch"] is not None)
"""


# The child runs on JAX's CPU backend: on a TPU host this process holds the chip (libtpu takes one process
# at a time), so artifacts made there name the CPU beside the TPU.
PLATFORMS = None if jax.default_backend() == "cpu" else (jax.default_backend(), "cpu")


def _run_with_jax_alone(tmp_path, state, flat, batch_specs):
    arrays = {f"s{i}": t.numpy() for i, t in enumerate(state)}
    arrays |= {f"b{i}": t.numpy().astype(spec["dtype"]) for i, (t, spec) in enumerate(zip(flat, batch_specs))}
    np.savez(tmp_path / "inputs.npz", **arrays)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "model.jaxexport"), str(tmp_path / "inputs.npz")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"  # torch was never imported
    return np.load(tmp_path / "inputs.npz.out.npy")


def test_exported_serving_graph_runs_with_jax_alone(tmp_path):
    torch.manual_seed(0)
    model = testing.ServingModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batch = testing.serving_batch()
    step = capture_train_step(model, opt, testing.serving_loss, batch)
    serving = to_inference(step, "aux.0")
    compiled = compile(serving)
    manifest = compiled.export(tmp_path / "model.jaxexport", platforms=PLATFORMS)
    assert manifest["baked_state"] == []
    assert manifest["platforms"] == list(PLATFORMS or ("cpu",))
    on_disk = json.loads((tmp_path / "model.jaxexport.json").read_text())
    assert (
        on_disk["outputs"] == manifest["outputs"] == [{"name": "aux.0", "shape": [2, 2], "dtype": "float32"}]
    )
    assert [s["name"] for s in on_disk["state"]] == [s.name for s in serving.signature.state]
    assert on_disk["meta"]["recir.inference"]["dropouts_removed"] == 1

    state = serving.init_state(model, opt)
    _, (expected,) = serving(state, batch)
    got = _run_with_jax_alone(tmp_path, state, serving.signature.flatten_batch(batch), on_disk["batch"])
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "dtype,baked,kernel",
    [("int8", True, "aten"), ("fp16", False, "aten"), ("none", True, "aten"), ("int8", False, "fbgemm")],
)
def test_quantised_or_baked_serving_graph_runs_with_jax_alone(tmp_path, dtype, baked, kernel):
    """Quantised tables (recir-embed-quantize-tables) are plain ATen, so the artifact still runs with JAX
    alone; ``baked_state`` embeds the state as StableHLO constants (the call takes the batch alone).
    ``kernel="fbgemm"`` tables (FBGEMM's packed uint8 rows) lower through recir::quantized_lookup's ATen
    reference, their fp16 scale and bias read by ``aten::view.dtype``."""
    torch.manual_seed(0)
    model = testing.ServingModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batch = testing.serving_batch()
    serving = to_inference(capture_train_step(model, opt, testing.serving_loss, batch), "aux.0")
    step = serving if dtype == "none" else QuantizeTables(dtype=dtype, kernel=kernel)(serving).step
    state = step.init_state(model, opt)
    compiled = compile(step)
    if baked:
        with pytest.raises(ConfigError, match=r"expected \d+ state tensors \(signature order\), got 1"):
            compiled.export(tmp_path / "bad.jaxexport", baked_state=state[:1])
    manifest = compiled.export(
        tmp_path / "model.jaxexport", baked_state=state if baked else None, platforms=PLATFORMS
    )
    specs = manifest["baked_state" if baked else "state"]
    assert manifest["state" if baked else "baked_state"] == []
    assert [s["name"] for s in specs] == step.signature.state_names()
    if dtype != "none":
        assert manifest["meta"]["recir.quantize"]["dtype"] == dtype
        assert manifest["meta"]["recir.quantize"]["kernel"] == kernel
        assert (
            specs[0]["dtype"] == {"int8": "uint8", "fp16": "float16" if kernel == "aten" else "uint8"}[dtype]
        )
    _, (expected,) = step(state, batch)
    flat = step.signature.flatten_batch(batch)
    got = _run_with_jax_alone(tmp_path, [] if baked else state, flat, manifest["batch"])
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_export_for_named_platforms(tmp_path):
    """``platforms=``: one lowering per named platform (a TPU's lowered on any host), listed in the
    manifest; the artifact still runs on the CPU. An unknown name is refused, naming the choices."""
    torch.manual_seed(0)
    model = testing.ServingModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batch = testing.serving_batch()
    serving = to_inference(capture_train_step(model, opt, testing.serving_loss, batch), "aux.0")
    compiled = compile(serving)
    with pytest.raises(ConfigError, match=r"unknown JAX platform\(s\) \['gpu'\].*'cuda'"):
        compiled.export(tmp_path / "bad.jaxexport", platforms=("cpu", "gpu"))
    assert not (tmp_path / "bad.jaxexport").exists()
    manifest = compiled.export(tmp_path / "model.jaxexport", platforms=("tpu", "cpu"))
    assert manifest["platforms"] == ["tpu", "cpu"]
    state = serving.init_state(model, opt)
    _, (expected,) = serving(state, batch)
    got = _run_with_jax_alone(tmp_path, state, serving.signature.flatten_batch(batch), manifest["batch"])
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
    # baked for a TPU, the constants reach the program through an optimization barrier (XLA's simplifier
    # otherwise folds a product of constants into a broadcast the TPU verifier rejects); not for the CPU
    for platforms, barrier in ((("tpu", "cpu"), True), (("cpu",), False)):
        compiled.export(tmp_path / "model.jaxexport", baked_state=state, platforms=platforms)
        exp = jax.export.deserialize(bytearray((tmp_path / "model.jaxexport").read_bytes()))
        assert ("optimization_barrier" in exp.mlir_module()) == barrier, platforms
        got = _run_with_jax_alone(tmp_path, [], serving.signature.flatten_batch(batch), manifest["batch"])
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
