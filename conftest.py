"""Root pytest configuration: the verification level for tests and the hardware-dependent skips."""

from __future__ import annotations

import os

import pytest

# Tests verify after every transform (docs/design.md: RECIR_VERIFY=2 is the test default).
os.environ.setdefault("RECIR_VERIFY", "2")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA device; none is present (torch.cuda.is_available() is False)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
