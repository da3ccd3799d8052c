"""Private APIs of torch, JAX and torchax that a RecIR package relies on, listed in one place per package.

Each lowering keeps a tuple of ``"module:attribute"`` strings (``"module"`` alone for a private module)
and the versions it was checked against. ``require_private_apis`` resolves them once, before the first
compile, and turns a missing one into one ``LoweringError`` naming the API, the installed version and
the checked ones, instead of an AttributeError from deep inside a dependency after an upgrade.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping, Sequence

from ._errors import LoweringError


def missing_private_apis(apis: Sequence[str]) -> list[str]:
    """The entries of ``apis`` (``"module:attr.attr"`` or ``"module"``) that do not resolve here."""
    missing = []
    for api in apis:
        module, _, attrs = api.partition(":")
        try:
            obj: object = importlib.import_module(module)
            for attr in filter(None, attrs.split(".")):
                obj = getattr(obj, attr)
        except (ImportError, AttributeError):
            missing.append(api)
    return missing


def _installed(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def require_private_apis(owner: str, apis: Sequence[str], checked: Mapping[str, Sequence[str]]) -> None:
    """Raise ``LoweringError`` if any of ``apis`` is missing; ``checked``: distribution -> versions tried."""
    _require(owner, tuple(apis), tuple((d, tuple(v)) for d, v in checked.items()))


@functools.cache
def _require(owner: str, apis: tuple[str, ...], checked: tuple[tuple[str, tuple[str, ...]], ...]) -> None:
    missing = missing_private_apis(apis)
    if not missing:
        return
    versions = "; ".join(f"{d} {_installed(d)} (checked: {', '.join(v)})" for d, v in checked)
    raise LoweringError(
        f"{owner} relies on private APIs that this installation lacks: {', '.join(missing)}.\n"
        f"Installed: {versions}. These APIs change between releases without notice.\n"
        f"Fix: install one of the checked versions, or update {owner}'s private API list (_private_apis.py) "
        "and the code that uses them."
    )
