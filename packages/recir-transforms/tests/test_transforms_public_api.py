"""The public surface of recir.transforms, and its promise to need torch only."""

import importlib
import subprocess
import sys

import recir.transforms as rt


def test_transforms_public_api_resolves():
    assert rt.__all__
    for name in rt.__all__:
        obj = getattr(rt, name)
        owner = getattr(obj, "__module__", None)
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            assert owner.startswith("recir.transforms"), (name, owner)
    assert len(set(rt.__all__)) == len(rt.__all__)


def test_transforms_error_hierarchy():
    for err in (rt.VerificationError, rt.CaptureError, rt.LoweringError, rt.ConfigError, rt.DataError):
        assert issubclass(err, rt.RecIRError)


def test_transforms_imports_torch_only():
    code = (
        "import sys, recir.transforms\n"
        "bad = [m for m in ('jax', 'torchax', 'torchrec', 'fbgemm_gpu', 'recir.capture', 'recir.embedding') "
        "if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"import recir.transforms loaded {out.stdout.strip()}"
    importlib.import_module("recir.transforms")
