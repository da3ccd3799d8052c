"""Known-broken torch/torchax pairs are refused at import with the versions and the fix."""

from __future__ import annotations

import pytest
from recir.lower_tpu._versions import incompatibility


@pytest.mark.parametrize(
    ("torch_version", "torchax_version", "broken"),
    [
        ("2.9.1+cu128", "0.0.13", False),
        ("2.12.0", "0.0.13", False),
        ("2.13.0", "0.0.13", True),
        ("2.15.0+cpu", "0.0.12", True),
        ("2.13.0.dev20260101", "0.0.13", True),
        ("2.13.0", "0.0.14", False),
        ("2.13.0", None, False),
    ],
)
@pytest.mark.smoke
def test_torchax_on_torch_2_13_is_a_clear_error(torch_version, torchax_version, broken):
    problem = incompatibility(torch_version, torchax_version)
    assert (problem is not None) == broken
    if broken:
        assert f"torch {torch_version}" in problem and "Fix: install torch < 2.13" in problem
