"""The public surface of recir.embedding: every name in __all__ resolves and belongs to the package."""

import importlib


def test_embedding_public_api_resolves():
    mod = importlib.import_module("recir.embedding")
    assert mod.__all__, "recir.embedding must export a public API"
    for name in mod.__all__:
        obj = getattr(mod, name)
        owner = getattr(obj, "__module__", None)
        assert owner is None or owner.startswith("recir.") or not callable(obj), (name, owner)
    assert mod.__version__ == "0.1.0"


def test_imports_stay_within_declared_dependencies():
    """recir.embedding imports recir.transforms, torch, torchrec and fbgemm only (JAX lazily)."""
    import subprocess
    import sys

    code = (
        "import sys, recir.embedding\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'jax' or m.startswith(("
        "'recir.capture', 'recir.lower_gpu', 'recir.lower_tpu', 'recir.distributed', 'recir.dlrmv3')))\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
