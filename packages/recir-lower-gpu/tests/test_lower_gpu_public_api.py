"""The public surface of recir.lower_gpu: every name in __all__ resolves and belongs to the package."""

import importlib

import pytest


@pytest.mark.smoke
def test_lower_gpu_public_api_resolves():
    mod = importlib.import_module("recir.lower_gpu")
    assert mod.__all__, "recir.lower_gpu must export a public API"
    for name in mod.__all__:
        obj = getattr(mod, name)
        owner = getattr(obj, "__module__", None)
        assert owner is None or owner.startswith("recir.") or not callable(obj), (name, owner)
    assert mod.__version__ == "0.1.0"


def test_lower_gpu_public_surface_is_pinned():
    import recir.lower_gpu as lg
    from recir.transforms import LoweringError

    assert set(lg.__all__) == {
        "__version__",
        "compile",
        "export",
        "package",
        "GPUCompiledStep",
        "FusedTBECompiledStep",
        "GPUOptions",
        "compile_in_turn",
        "INDUCTOR_MODES",
        "resolve_device",
        "inductor_cache_dir",
        "recir_cache_dir",
        "retain_host_memory",
        "LoweringError",
    }
    assert lg.LoweringError is LoweringError
    assert lg.INDUCTOR_MODES == ("default", "reduce-overhead", "max-autotune-no-cudagraphs")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    import recir.lower_gpu as lg

    monkeypatch.setenv("RECIR_CACHE_DIR", str(tmp_path))
    assert lg.recir_cache_dir() == tmp_path
    assert lg.inductor_cache_dir("/x/y") == __import__("pathlib").Path("/x/y")
    from recir.lower_gpu import _cache

    monkeypatch.setattr(_cache, "_USER_INDUCTOR_DIR", None)
    assert lg.inductor_cache_dir() == tmp_path / "inductor"
    monkeypatch.setattr(_cache, "_USER_INDUCTOR_DIR", str(tmp_path / "user"))
    assert lg.inductor_cache_dir() == tmp_path / "user"
