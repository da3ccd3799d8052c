"""Known incompatibilities of the TPU stack, reported at import with the versions and the fix (instead of
an AttributeError from deep inside torchax)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string (``2.13.0+cu130`` -> (2, 13, 0); a pre-release's base)."""
    out = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


def incompatibility(torch_version: str, torchax_version: str | None) -> str | None:
    """Why this (torch, torchax) pair cannot work, or None. torchax up to 0.0.13 registers named-tensor
    overloads (e.g. ``prod.dim_Dimname``) that torch 2.13 removed, and fails at import."""
    if torchax_version is None:
        return None
    if _release(torch_version) >= (2, 13) and _release(torchax_version) <= (0, 0, 13):
        return (
            f"torchax {torchax_version} does not work with torch {torch_version}: it registers named-tensor "
            "overloads (such as prod.dim_Dimname) that torch 2.13 removed. Fix: install torch < 2.13 "
            "(pip install 'torch<2.13'), or a torchax release newer than 0.0.13 that supports it."
        )
    return None


def check_stack() -> None:
    import torch

    try:
        tx = version("torchax")
    except PackageNotFoundError:
        tx = None
    problem = incompatibility(torch.__version__, tx)
    if problem:
        raise ImportError(f"recir.lower_tpu: {problem}")


check_stack()  # at import of recir.lower_tpu, before any module of it imports torchax
