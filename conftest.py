"""Root pytest configuration: the verification level for tests and the hardware-dependent skips."""

from __future__ import annotations

import os
from typing import Any

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


# The `standalone` nox sessions run a library package's tests without the optional dependencies it does not
# declare (RECIR_TESTS_WITHOUT="torchrec,fbgemm_gpu"). A test whose own code imports one of them (to build a
# TorchRec model, compare against FBGEMM or use a sibling package the one under test does not declare) is
# skipped there; an import of one from library code still fails, since the libraries must work without them.
_ABSENT_ON_PURPOSE = {m for m in os.environ.get("RECIR_TESTS_WITHOUT", "").split(",") if m}


def _imported_by_test_code(excinfo: pytest.ExceptionInfo[BaseException]) -> str | None:
    exc = excinfo.value
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    name = exc.name
    if not any(name == m or name.startswith(m + ".") for m in _ABSENT_ON_PURPOSE):
        return None
    frames = [e for e in excinfo.traceback if not str(e.path).startswith("<frozen")]
    if frames and f"{os.sep}tests{os.sep}" in str(frames[-1].path):
        return name
    return None


def _skip_absent(outcome: Any) -> None:  # a pluggy Result
    if outcome.excinfo is None:
        return
    missing = _imported_by_test_code(pytest.ExceptionInfo.from_exc_info(outcome.excinfo))
    if missing is not None:
        outcome.force_exception(
            pytest.skip.Exception(f"needs {missing}, absent on purpose (RECIR_TESTS_WITHOUT)")
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    outcome = yield
    if _ABSENT_ON_PURPOSE:
        _skip_absent(outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    outcome = yield
    if _ABSENT_ON_PURPOSE:
        _skip_absent(outcome)
