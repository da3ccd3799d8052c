"""The public surface of recir.embedding: every name in __all__ resolves and belongs to the package."""

import importlib

import pytest


@pytest.mark.smoke
def test_embedding_public_api_resolves():
    mod = importlib.import_module("recir.embedding")
    assert mod.__all__, "recir.embedding must export a public API"
    for name in mod.__all__:
        obj = getattr(mod, name)
        owner = getattr(obj, "__module__", None)
        assert owner is None or owner.startswith("recir.") or not callable(obj), (name, owner)
    assert mod.__version__ == "0.1.0"
    # moved here from recir.capture: the optimizer and override for plain embedding tables
    assert {"RowWiseAdagrad", "EmbeddingBagOverride", "EmbeddingBagStandIn"} <= set(mod.__all__)


def test_imports_stay_within_declared_dependencies():
    """recir.embedding imports recir.transforms, torch, torchrec and fbgemm only (never JAX)."""
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


def test_embedding_never_imports_or_requires_jax():
    """JAX belongs to recir-lower-tpu, which lowers the recir::ring_shift_* ops: no source file here
    imports it and the package metadata (extras included) does not list it."""
    import ast
    import pathlib
    import tomllib

    pkg = pathlib.Path(importlib.import_module("recir.embedding").__file__).parent
    found = []
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("jax", "jaxlib", "torchax")]
    assert not found, found
    meta = tomllib.loads((pkg.parents[2] / "pyproject.toml").read_text())["project"]
    deps = [*meta["dependencies"], *(d for ds in meta.get("optional-dependencies", {}).values() for d in ds)]
    assert not [d for d in deps if d.startswith(("jax", "torchax"))], deps
