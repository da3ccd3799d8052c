"""Makes this folder's helper module (``_lower_gpu_steps``) importable under --import-mode=importlib."""

import sys
from pathlib import Path

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def lower_gpu_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One Inductor cache folder per test session: hermetic, shared by this package's tests."""
    return str(tmp_path_factory.mktemp("recir-inductor-cache"))
