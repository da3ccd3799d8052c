"""The state-slot name grammar: one formatter and one parser, round-tripping every form."""

from __future__ import annotations

import pytest
from recir.transforms import (
    RNG_OFFSET_SLOT,
    RNG_SEED_SLOT,
    STEP_SLOT,
    ConfigError,
    SlotName,
    buffer_slot,
    lr_slot,
    optim_slot,
    param_slot,
    parse_slot_name,
    rng_slot,
    slot_path,
)


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        (param_slot("hstu.layers.0.qkv.weight"), SlotName("param", path="hstu.layers.0.qkv.weight")),
        (buffer_slot("bn.running_mean"), SlotName("buffer", path="bn.running_mean")),
        (optim_slot("emb.weight", "exp_avg"), SlotName("optim", path="emb.weight", key="exp_avg")),
        (STEP_SLOT, SlotName("optim", key="step")),
        (lr_slot(3), SlotName("optim", key="lr", group=3)),
        (RNG_SEED_SLOT, SlotName("rng", key="seed")),
        (rng_slot("offset"), SlotName("rng", key="offset")),
    ],
)
def test_slot_names_round_trip(name, parsed):
    assert parse_slot_name(name) == parsed
    assert str(parsed) == name


def test_slot_name_forms_and_paths():
    assert param_slot("a.b") == "param:a.b" and optim_slot("a.b", "sum") == "optim:a.b:sum"
    assert lr_slot(0) == "optim:group0:lr" and STEP_SLOT == "optim:step" and RNG_OFFSET_SLOT == "rng:offset"
    assert parse_slot_name(STEP_SLOT).is_step and parse_slot_name(lr_slot(1)).is_lr
    assert not parse_slot_name(optim_slot("x", "step")).is_step  # a per-parameter step count
    assert slot_path("param:a.b") == slot_path("optim:a.b:exp_avg") == "a.b"
    assert slot_path(STEP_SLOT) is None and slot_path(lr_slot(0)) is None and slot_path(RNG_SEED_SLOT) is None


@pytest.mark.parametrize("bad", ["weight", "param:", "opt:x", "optim:", "optim::sum", "optim:x:", "rng:"])
def test_malformed_slot_names_are_refused_with_the_grammar(bad):
    with pytest.raises(ConfigError, match=r"param:<path>, buffer:<path>, optim:<path>:<key>.*Fix:"):
        parse_slot_name(bad)
