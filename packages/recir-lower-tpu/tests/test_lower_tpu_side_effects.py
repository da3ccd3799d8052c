"""compile sets JAX's persistent-cache options only while it compiles: afterwards the options hold their
old values and a user's own jax.jit is not cached into RecIR's folder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch
from recir.lower_tpu import TPUOptions, compile
from recir.lower_tpu._cache import _CACHE_OPTIONS, read_option
from torch import nn


def test_compile_leaves_jax_as_it_was(tmp_path, sgd_step):
    before = {name: read_option(name) for name in _CACHE_OPTIONS}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    batch = {"x": torch.ones(2, 3), "y": torch.zeros(2, 1)}
    step = sgd_step(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), batch, lr=0.05)
    compiled = compile(step, options=TPUOptions(cache_dir=str(tmp_path)))
    compiled(compiled.init_state(model), batch)
    cached = sorted(tmp_path.rglob("*"))
    assert cached  # RecIR's compile used its cache
    assert {name: read_option(name) for name in _CACHE_OPTIONS} == before
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 1)(jnp.arange(7.0)).block_until_ready()  # the user's own program
    assert sorted(tmp_path.rglob("*")) == cached
