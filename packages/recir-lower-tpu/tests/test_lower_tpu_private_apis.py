"""recir.lower_tpu's private torch/torchax APIs: listed in _private_apis.py, all resolving here."""

from __future__ import annotations

import re
from pathlib import Path

from recir.lower_tpu import _private_apis
from recir.transforms import missing_private_apis


def test_listed_private_apis_resolve_and_cover_the_sources():
    assert missing_private_apis(_private_apis.PRIVATE_APIS) == []
    listed = {api.split(":")[0] for api in _private_apis.PRIVATE_APIS}
    sources = [
        p.read_text() for p in Path(_private_apis.__file__).parent.glob("*.py") if p.stem != "_private_apis"
    ]
    used = {
        m
        for text in sources
        for m in re.findall(r"\b(torch\._[a-z][a-z_.]*[a-z]|torchax\.[a-z_.]*[a-z])", text)
    }
    unlisted = sorted(
        m for m in used if not any(x == m or x.startswith(m + ".") or m.startswith(x) for x in listed)
    )
    assert not unlisted, f"add these to recir/lower_tpu/_private_apis.py: {unlisted}"
