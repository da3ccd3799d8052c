"""The public surface of recir.dlrmv3: every name in __all__ resolves and belongs to the package."""

import importlib

import pytest


@pytest.mark.smoke
def test_dlrmv3_public_api_resolves():
    mod = importlib.import_module("recir.dlrmv3")
    assert mod.__all__, "recir.dlrmv3 must export a public API"
    for name in mod.__all__:
        obj = getattr(mod, name)
        owner = getattr(obj, "__module__", None)
        assert owner is None or owner.startswith("recir.") or not callable(obj), (name, owner)
    assert mod.__version__ == "0.1.0"
