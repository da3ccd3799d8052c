"""A FBGEMM built for another torch is refused with both versions and the fix, before its operators load."""

from __future__ import annotations

import importlib.metadata

import pytest
from recir.embedding import _versions
from recir.embedding._versions import fbgemm_mismatch


@pytest.mark.parametrize(
    ("torch_version", "fbgemm_version", "broken"),
    [
        ("2.10.0+cu128", "1.5.0", False),
        ("2.9.1", "1.4.2", False),
        ("2.12.1+cpu", "1.7.0", False),
        ("2.10.0+cu128", "1.4.2", True),
        ("2.11.0", "1.5.0rc1", True),
        ("2.9.1", "1.9.0", True),
        ("2.16.0", "1.9.0", False),  # a torch the table does not know: nothing to say
    ],
)
@pytest.mark.smoke
def test_fbgemm_built_for_another_torch_is_a_clear_error(torch_version, fbgemm_version, broken):
    problem = fbgemm_mismatch(torch_version, "fbgemm-gpu-cpu", fbgemm_version)
    assert (problem is not None) == broken
    if broken:
        assert f"fbgemm-gpu-cpu {fbgemm_version} is built for torch " in problem
        assert f"not the installed torch {torch_version}" in problem
        wanted = _versions.FBGEMM_FOR_TORCH[".".join(torch_version.split(".")[:2])]
        assert f"pip install 'fbgemm-gpu-cpu=={wanted}.*' 'torchrec=={wanted}.*'" in problem


def test_the_fbgemm_backend_refuses_a_mismatched_install(monkeypatch):
    """The check runs where RecIR first loads FBGEMM (the fbgemm backend, FusedTBE), on the installed versions."""
    from recir.embedding import _ops

    monkeypatch.setattr(_versions, "installed_fbgemm", lambda: ("fbgemm-gpu-cpu", "1.0.0"))
    monkeypatch.setattr(_versions, "FBGEMM_FOR_TORCH", {**_versions.FBGEMM_FOR_TORCH, "1.0": "9.9"})
    import torch

    monkeypatch.setattr(torch, "__version__", "1.0.0")
    with pytest.raises(
        ImportError, match=r"fbgemm-gpu-cpu 1.0.0 is built for another torch, not the installed torch 1.0.0"
    ):
        _ops._fbgemm()


def test_the_locked_stack_is_a_matching_pair():
    """The lock's torch and FBGEMM agree with the table (else the table, or the lock, is wrong)."""
    found = _versions.installed_fbgemm()
    if found is None:
        pytest.skip("no FBGEMM installed")
    import torch

    assert fbgemm_mismatch(torch.__version__, *found) is None, importlib.metadata.version(found[0])
