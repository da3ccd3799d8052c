"""The private torch APIs recir.lower_gpu uses are listed in _private_apis.py, and all resolve here."""

from __future__ import annotations

import re
from pathlib import Path

from recir.lower_gpu import _private_apis
from recir.transforms import missing_private_apis

SRC = Path(_private_apis.__file__).parent


def test_every_listed_private_api_resolves():
    assert missing_private_apis(_private_apis.PRIVATE_APIS) == []


def test_every_private_torch_module_used_is_listed():
    listed = {api.split(":")[0] for api in _private_apis.PRIVATE_APIS}
    used = set()
    for path in SRC.glob("*.py"):
        if path.name != "_private_apis.py":
            used |= set(re.findall(r"\b(torch\._[a-z][a-z_]*(?:\.[a-z_]+)*)", path.read_text()))
    unlisted = {
        m for m in used if not any(m == x or x.startswith(m + ".") or m.startswith(x) for x in listed)
    }
    assert not unlisted, f"add these to recir/lower_gpu/_private_apis.py: {sorted(unlisted)}"
