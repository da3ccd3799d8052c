"""The public surface of recir.lower_gpu: every name in __all__ resolves and belongs to the package."""

import importlib
import os

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


def test_torchs_own_default_inductor_dir_is_not_taken_for_a_users_choice(tmp_path):
    # torch writes /tmp/torchinductor_<user> into TORCHINDUCTOR_CACHE_DIR the first time anything asks
    # for its cache folder (importing torchrec does); RecIR's folder must still be used then.
    import subprocess
    import sys

    code = (
        "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
        "cache_dir()\n"  # what importing torchrec does
        "import recir.lower_gpu as lg\n"
        "print(lg.inductor_cache_dir())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["RECIR_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "inductor")
    # a user's own setting still wins
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "mine")
