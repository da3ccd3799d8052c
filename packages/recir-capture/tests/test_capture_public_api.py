"""The public surface of recir.capture: every name in __all__ resolves and belongs to the package."""

import importlib
import subprocess
import sys

import pytest

PUBLIC = {
    "capture_train_step",
    "BucketedStep",
    "CaptureError",
    "state_from",
    "load_into",
    "with_shared_step",
    "shared_step_layout",
    "is_parameter_step",
    "ParamOptim",
    "apply_update",
    "set_learning_rate",
    "sync_learning_rates",
    "learning_rates",
    "capture_decompositions",
    "check_decomposition_table",
    "OPTIMIZER_META",
    "LR_SLOTS_META",
    "GRAD_OF_KEY",
    "OPTIM_PARAM_KEY",
    "testing",
    "__version__",
}


@pytest.mark.smoke
def test_capture_public_api_resolves():
    mod = importlib.import_module("recir.capture")
    assert mod.__all__, "recir.capture must export a public API"
    for name in mod.__all__:
        obj = getattr(mod, name)
        owner = getattr(obj, "__module__", None)
        assert owner is None or owner.startswith("recir.") or not callable(obj), (name, owner)
    assert mod.__version__ == "0.1.0"
    assert set(mod.__all__) == PUBLIC
    testing = importlib.import_module("recir.capture.testing")
    assert {"MLP", "TransformerBlock", "EmbeddingBagModel", "BatchNormModel", "REFERENCE_CASES"} <= set(
        testing.__all__
    )


def test_capture_public_api_imports_only_its_dependencies():
    """recir-capture depends on torch and recir-transforms only (checked in a fresh interpreter)."""
    code = (
        "import sys, recir.capture, recir.capture.testing\n"
        "bad = [m for m in ('jax', 'torchax', 'torchrec', 'fbgemm_gpu', 'recir.embedding', 'recir.distributed', "
        "'recir.lower_gpu', 'recir.lower_tpu', 'recir.dlrmv3') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
