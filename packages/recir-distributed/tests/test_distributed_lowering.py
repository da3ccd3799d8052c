"""The per-device programs lower through recir.lower_gpu (Inductor on the CPU device) on gloo processes and
match the eager interpreter: FSDP's all-gather / reduce-scatter / all-reduce become compiled collectives.
"""

from __future__ import annotations

import pytest
from _distributed_workers import compiled_matches_eager, spawn


def test_fsdp_step_compiles_with_inductor_on_two_ranks():
    pytest.importorskip("recir.lower_gpu")  # the ranks compile with it (a test-time sibling)
    spawn(compiled_matches_eager, 2, "mlp", ["fsdp"], 3)
