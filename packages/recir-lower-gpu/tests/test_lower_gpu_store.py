"""``store_rng_masks``: each dropout keep mask is computed once and stored, not recomputed by every
kernel that reads it; the numbers are bit-for-bit those of the un-stored step."""

from __future__ import annotations

import logging

import pytest
import recir.lower_gpu as lg
import torch
from recir.capture import capture_train_step, testing
from recir.lower_gpu._prepare import copy_graph_module
from recir.lower_gpu._store import store_rng_masks
from recir.transforms import RECOMPUTE_KEY, Recompute


def _step():
    torch.manual_seed(0)
    model = testing.TransformerBlock(dropout=0.3)
    case = testing.REFERENCE_CASES["transformer"]
    opt = testing.make_optimizer("adam", model.parameters())
    return model, opt, case, capture_train_step(model, opt, case.loss_fn, case.make_batch(0))


def test_store_rng_masks_routes_every_reader_through_one_store():
    _, _, _, step = _step()
    gm = copy_graph_module(step.graph_module)
    assert store_rng_masks(gm) == 2
    stores = [n for n in gm.graph.nodes if n.target is torch.ops.recir.store.default]
    assert len(stores) == 2
    for s in stores:
        (mask,) = s.args
        assert list(mask.users) == [s]  # every other reader now reads the stored copy
        assert s.users


def test_stored_masks_give_the_same_bits(lower_gpu_cache_dir, caplog):
    model, opt, case, step = _step()
    runs = {}
    for store in (False, True):
        options = lg.GPUOptions(store_rng_masks=store, cache_dir=lower_gpu_cache_dir)
        with caplog.at_level(logging.INFO, logger="recir.lower_gpu"):
            compiled = lg.compile(step, device="cpu", options=options)
        torch.manual_seed(1)  # the rng:seed slot's initial value
        state = compiled.init_state(model, opt)
        losses = []
        for i in range(3):
            state, (loss, *_) = compiled(state, case.make_batch(i))
            losses.append(loss)
        runs[store] = (torch.stack(losses), compiled.state_dict(state))
    assert "2 dropout mask(s) stored once" in caplog.text
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=0, atol=0)
    for name, value in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("store", [False, True, None])
def test_store_rng_masks_option_is_respected(store, lower_gpu_cache_dir, caplog):
    _, _, _, step = _step()
    recomputed = Recompute(modules=("*",))(step.copy()).step
    # the same barriers as a model's own (a custom backward recomputing what it did not keep): no
    # recir-recompute-activations copies, so nothing recomputes a dropout mask
    own = recomputed.copy()
    for node in own.graph.nodes:
        node.meta.pop(RECOMPUTE_KEY, None)
    assert any(n.target is torch.ops.recir.recompute_barrier.default for n in own.graph.nodes)
    cases = ((step, bool(store)), (recomputed, store is not False), (own, bool(store)))
    for graph, stored in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="recir.lower_gpu"):
            lg.compile(
                graph,
                device="cpu",
                options=lg.GPUOptions(store_rng_masks=store, cache_dir=lower_gpu_cache_dir),
            )
        # None (the default): stored only in a step that recomputes activations, where the mask is what
        # the backward keeps (as bytes, not as an int64 stage of its hash); elsewhere measured slower on CPU
        assert ("stored once" in caplog.text) == stored, (store, graph is recomputed)
    assert lg.GPUOptions().store_rng_masks is None
