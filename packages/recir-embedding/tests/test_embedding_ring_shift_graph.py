"""``prepare_for_lowering(backend="ring_shift")``: lookups of row-sharded tables, and the sparse row
update's reads and writes of them, become ``recir::ring_shift_*`` ops carrying their mesh axis (eagerly
the plain ATen maths); the gradients up to the row update stay ATen.
"""

from __future__ import annotations

import copy

import pytest
import torch
from recir.embedding import ConfigError, overrides, prepare_for_lowering
from recir.embedding._testing import DEFAULTS, build_step
from recir.transforms import PHASE_KEY, apply_overrides

pytest.importorskip("jax")


def _captured(helpers):
    model, _ = apply_overrides(copy.deepcopy(helpers.make_torchrec_model()), overrides())
    batch, _ = helpers.random_batch(torch.Generator().manual_seed(1))
    step = build_step(model, helpers.loss_fn, batch, "adagrad", dict(DEFAULTS["adagrad"]))
    tables = sorted({s.name for s in step.signature.state if s.kind == "param" and "weight" in s.name})
    return model, step, tables


def test_ring_shift_marks_row_sharded_lookups(helpers):
    model, step, tables = _captured(helpers)
    ring = prepare_for_lowering(
        step, backend="ring_shift", target="tpu", row_sharded=dict.fromkeys(tables, "x")
    )
    ops = [n for n in ring.graph.nodes if n.op == "call_function" and "ring_shift" in str(n.target)]
    lookups = [n for n in ops if n.meta[PHASE_KEY] == "forward"]
    kinds = sorted(str(n.target) for n in lookups)
    assert kinds == ["recir.ring_shift_embedding.default"] + ["recir.ring_shift_embedding_bag.default"] * 2
    assert all(n.args[-1] == "x" for n in ops)
    # the sparse row update reads the touched rows of each table through the ring and adds the deltas
    # back into the owner shard (the tables only here: their Adagrad state is not in row_sharded)
    slots = [s.name for s in ring.signature.state]
    placeholders = [n for n in ring.graph.nodes if n.op == "placeholder"]
    updates = sorted(
        (str(n.target), slots[placeholders.index(n.args[0])]) for n in ops if n.meta[PHASE_KEY] == "optimizer"
    )
    assert updates == sorted(
        (f"recir.ring_shift_{op}.default", t) for t in tables for op in ("embedding", "index_add")
    ), updates
    assert ring.meta["recir.embedding"]["row_updates"] == 2 * len(tables)
    assert not [n for n in ops if n.meta[PHASE_KEY] == "backward"]
    assert ring.meta["recir.embedding"]["backend"] == "ring_shift"
    assert len(ring.meta["recir.embedding"]["sparsify"]["sparsified"]) == 3  # gradients stay row updates
    ref = prepare_for_lowering(step, backend="in_graph", target="tpu")
    s_ring, s_ref = ring.init_state(model), ref.init_state(model)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        batch, _ = helpers.random_batch(gen)
        s_ring, out_ring = ring(s_ring, batch)
        s_ref, out_ref = ref(s_ref, batch)
        torch.testing.assert_close(out_ring, out_ref)
    for a, b in zip(s_ring, s_ref):
        torch.testing.assert_close(a, b)


def test_ring_shift_needs_row_sharded_tables(helpers):
    _, step, tables = _captured(helpers)
    with pytest.raises(ConfigError, match="ring_shift' needs row-wise sharded tables on a mesh"):
        prepare_for_lowering(step, backend="ring_shift", target="tpu")
    with pytest.raises(ConfigError, match=f"reads table '{tables[0]}', which is not row-wise sharded"):
        prepare_for_lowering(step, backend="ring_shift", target="tpu", row_sharded={tables[1]: "x"})
