"""``initialize_distributed`` rejects a bad process id or environment value before it contacts anyone."""

from __future__ import annotations

import pytest
from recir.lower_tpu import initialize_distributed
from recir.transforms import ConfigError


def test_initialize_distributed_rejects_bad_ids(monkeypatch):
    with pytest.raises(ConfigError, match=r"process id 2 is outside 0\.\.1 for 2 processes"):
        initialize_distributed("127.0.0.1:1234", num_processes=2, process_id=2)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='two' is not a non-negative integer"):
        initialize_distributed("127.0.0.1:1234", process_id=0)
