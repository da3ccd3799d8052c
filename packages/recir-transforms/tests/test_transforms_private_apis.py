"""require_private_apis: a missing private API of a dependency is one LoweringError naming it."""

from __future__ import annotations

import pytest
from recir.transforms import LoweringError, missing_private_apis, require_private_apis


def test_missing_private_apis_resolves_modules_and_attribute_chains():
    present = ["torch._ops:OpOverload", "torch._decomp", "torch.nn:Module.forward"]
    absent = ["torch._ops:NoSuchThing", "torch._no_such_module", "torch.nn:Module.no_such_method"]
    assert missing_private_apis(present + absent) == absent


def test_require_private_apis_names_the_api_and_the_versions():
    require_private_apis("recir.x", ["torch._ops:OpOverload"], {"torch": ["2.9.1"]})  # present: no error
    with pytest.raises(LoweringError) as info:
        require_private_apis(
            "recir.x", ["torch._ops:Gone"], {"torch": ["2.9.1", "2.11.0"], "nonexistent-dist": ["1"]}
        )
    message = str(info.value)
    assert "torch._ops:Gone" in message and "checked: 2.9.1, 2.11.0" in message
    assert "nonexistent-dist not installed" in message and "Fix:" in message
