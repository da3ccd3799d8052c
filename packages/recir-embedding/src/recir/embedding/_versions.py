"""The FBGEMM (and TorchRec) release built for each torch, and the check that refuses a mismatched pair with
the versions and the fix, before FBGEMM's compiled operators fail to load (measured: fbgemm-gpu-cpu 1.4.2 next to
torch 2.10.0 logs "Could not load the library" and raises an OSError naming a .so file).

Standard library only: ``noxfile.py`` reads ``FBGEMM_FOR_TORCH`` from this file without importing torch.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# torch minor -> FBGEMM and TorchRec minor (both packages share minor numbers). FBGEMM's operators load only
# into the torch they were built against, and neither package's metadata says which that is. Add a row when
# FBGEMM publishes a release for a new torch.
FBGEMM_FOR_TORCH = {"2.9": "1.4", "2.10": "1.5", "2.11": "1.6", "2.12": "1.7", "2.13": "1.8", "2.14": "1.9"}
FBGEMM_DISTRIBUTIONS = ("fbgemm-gpu", "fbgemm-gpu-cpu", "fbgemm-gpu-genai")


def _minor(text: str) -> str:
    """``2.10.0+cu128`` -> ``2.10``; ``1.5.0rc1`` -> ``1.5``."""
    parts = text.split("+")[0].split(".")
    return ".".join("".join(c for c in p if c.isdigit()) or "0" for p in parts[:2])


def fbgemm_mismatch(torch_version: str, fbgemm: str, fbgemm_version: str) -> str | None:
    """Why FBGEMM distribution ``fbgemm`` at ``fbgemm_version`` cannot load into torch ``torch_version``, or
    None (also None for a torch this table does not know: nothing to say about it)."""
    wanted = FBGEMM_FOR_TORCH.get(_minor(torch_version))
    if wanted is None or _minor(fbgemm_version) == wanted:
        return None
    built_for = [t for t, f in FBGEMM_FOR_TORCH.items() if f == _minor(fbgemm_version)]
    return (
        f"{fbgemm} {fbgemm_version} is built for {f'torch {built_for[0]}' if built_for else 'another torch'}, "
        f"not the installed torch {torch_version}; its operators cannot load into this torch. Fix: install "
        f"the FBGEMM built for it (pip install '{fbgemm}=={wanted}.*' 'torchrec=={wanted}.*'), or the torch "
        f"that FBGEMM {fbgemm_version} is built for."
    )


def installed_fbgemm() -> tuple[str, str] | None:
    """The installed FBGEMM distribution and its version, or None."""
    for dist in FBGEMM_DISTRIBUTIONS:
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    return None


def check_fbgemm() -> None:
    """Raise ImportError naming both versions and the fix when the installed FBGEMM is built for another torch."""
    found = installed_fbgemm()
    if found is None:
        return
    import torch

    problem = fbgemm_mismatch(torch.__version__, *found)
    if problem:
        raise ImportError(f"recir.embedding: {problem}")
