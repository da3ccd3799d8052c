"""TPU-path export: a serving graph (to_inference) as a serialised jax.export artifact with a manifest,
loaded and run in a process where torch cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from recir.capture import capture_train_step, testing
from recir.lower_tpu import compile
from recir.transforms import to_inference

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
_, outs = exp.call(state, batch)
np.save(inputs + ".out.npy", np.asarray(outs[0]))
print("torch" in sys.modules and sys.modules["torch"] is not None)
"""


def test_exported_serving_graph_runs_with_jax_alone(tmp_path):
    torch.manual_seed(0)
    model = testing.ServingModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    batch = testing.serving_batch()
    step = capture_train_step(model, opt, testing.serving_loss, batch)
    serving = to_inference(step, "aux.0")
    compiled = compile(serving)
    manifest = compiled.export(tmp_path / "model.jaxexport")
    on_disk = json.loads((tmp_path / "model.jaxexport.json").read_text())
    assert (
        on_disk["outputs"] == manifest["outputs"] == [{"name": "aux.0", "shape": [2, 2], "dtype": "float32"}]
    )
    assert [s["name"] for s in on_disk["state"]] == [s.name for s in serving.signature.state]
    assert on_disk["meta"]["recir.inference"]["dropouts_removed"] == 1

    state = serving.init_state(model, opt)
    _, (expected,) = serving(state, batch)
    flat = serving.signature.flatten_batch(batch)
    arrays = {f"s{i}": t.numpy() for i, t in enumerate(state)}
    arrays |= {
        f"b{i}": t.numpy().astype(spec["dtype"]) for i, (t, spec) in enumerate(zip(flat, on_disk["batch"]))
    }
    np.savez(tmp_path / "inputs.npz", **arrays)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "model.jaxexport"), str(tmp_path / "inputs.npz")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"  # torch was never imported
    got = np.load(tmp_path / "inputs.npz.out.npy")
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-6)
