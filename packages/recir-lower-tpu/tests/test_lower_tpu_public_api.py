"""The public surface of recir.lower_tpu: every name in __all__ resolves and belongs to the package."""

import importlib

import pytest


@pytest.mark.smoke
def test_lower_tpu_public_api_resolves():
    mod = importlib.import_module("recir.lower_tpu")
    assert mod.__all__, "recir.lower_tpu must export a public API"
    for name in mod.__all__:
        obj = getattr(mod, name)
        owner = getattr(obj, "__module__", None)
        assert owner is None or owner.startswith("recir.") or not callable(obj), (name, owner)
    assert mod.__version__ == "0.1.0"
