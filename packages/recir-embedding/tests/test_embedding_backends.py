"""Every embedding backend against a plain-PyTorch reference trained eagerly, for 10 steps.

Pooled sum and mean, unpooled sequences, a table shared by two features, repeated ids; parameters and
optimizer state are compared after every step. Also: where each backend refuses to run.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from recir.embedding import ConfigError, overrides, prepare_for_lowering
from recir.embedding._testing import DEFAULTS, build_step
from recir.transforms import apply_overrides

CASES = [
    ("in_graph", "sgd"),
    ("in_graph", "adagrad"),
    ("in_graph", "rowwise_adagrad"),
    ("in_graph", "adam"),
    ("fbgemm", "rowwise_adagrad"),
    ("fbgemm", "adam"),
    ("torchrec", "adagrad"),
    ("torchrec", "sgd"),
]


def _captured(helpers, kind):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    gen = torch.Generator().manual_seed(1)
    batch, _ = helpers.random_batch(gen)
    hp = dict(DEFAULTS[kind])
    return tr, model, build_step(model, helpers.loss_fn, batch, kind, hp), hp


@pytest.mark.smoke
@pytest.mark.parametrize("backend,kind", CASES)
def test_backend_matches_eager_reference_for_10_steps(helpers, backend, kind):
    tr, model, step, hp = _captured(helpers, kind)
    lowered = prepare_for_lowering(step, backend=backend, target="gpu", device="cpu")
    report = lowered.meta["recir.embedding"]
    assert report["backend"] == backend and report["lookups"] == 3
    assert len(report["sparsify"]["sparsified"]) == 3, report
    ref = helpers.make_reference(tr, kind, hp)
    state = lowered.init_state(model)
    gen = torch.Generator().manual_seed(7)
    for i in range(10):
        batch, kjt = helpers.random_batch(gen)
        state, (loss,) = lowered(state, batch)
        ref_loss = ref.step(kjt, batch["y"])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=f"loss, step {i}")
        sd = lowered.state_dict(state)
        for table in ("t1", "t2", "s1"):
            for name, want in ref.state_of(table).items():
                torch.testing.assert_close(sd[name], want, rtol=1e-5, atol=1e-6, msg=f"{name}, step {i}")


def test_lookup_nodes_per_backend(helpers):
    _, _, step, _ = _captured(helpers, "sgd")
    targets = {}
    for backend in ("in_graph", "fbgemm", "torchrec"):
        lowered = prepare_for_lowering(step, backend=backend, target="gpu", device="cpu")
        targets[backend] = sorted({str(n.target) for n in lowered.graph.nodes if "recir." in str(n.target)})
    assert targets["in_graph"] == ["recir.check_jagged.default"]
    assert targets["fbgemm"] == [
        "recir.check_jagged.default",
        "recir.fbgemm_embedding.default",
        "recir.fbgemm_embedding_bag.default",
    ]
    assert targets["torchrec"] == [
        "recir.check_jagged.default",
        "recir.torchrec_embedding.default",
        "recir.torchrec_embedding_bag.default",
    ]
    # TPU: pure ATen, no opaque op left (checks move to the host)
    tpu = prepare_for_lowering(step, target="tpu")
    assert tpu.meta["recir.embedding"]["backend"] == "in_graph"
    assert not [n for n in tpu.graph.nodes if "recir." in str(n.target)]
    # the input step is untouched
    assert any("recir.embedding_bag" in str(n.target) for n in step.graph.nodes)


def test_backends_refuse_where_they_cannot_run(helpers, monkeypatch):
    _, _, step, _ = _captured(helpers, "sgd")
    for backend in ("fbgemm", "torchrec"):
        with pytest.raises(ConfigError, match=f"{backend}.*cannot run on target 'tpu'"):
            prepare_for_lowering(step, backend=backend, target="tpu")
    with pytest.raises(ConfigError, match="ring_shift.*TPU path"):
        prepare_for_lowering(step, backend="ring_shift", target="gpu")
    with pytest.raises(ConfigError, match="unknown embedding backend 'nope'"):
        prepare_for_lowering(step, backend="nope", target="gpu")
    with pytest.raises(ConfigError, match="target 'cpu'"):
        prepare_for_lowering(step, target="cpu")
    monkeypatch.setitem(sys.modules, "jax", None)
    with pytest.raises(ImportError, match="ring_shift.*needs JAX"):
        prepare_for_lowering(step, backend="ring_shift", target="tpu")
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)
    with pytest.raises(ImportError, match="fbgemm.*recir-embedding\\[fbgemm-cpu\\]"):
        prepare_for_lowering(step, backend="fbgemm", target="gpu")


def test_fbgemm_on_cuda_needs_fbgemm_cuda_kernels(helpers, monkeypatch):
    # Only FBGEMM's CPU build: CUDA defaults to in_graph, and asking for fbgemm on CUDA names the fix.
    from recir.embedding import _ops
    from recir.embedding._backends import default_backend

    _, _, step, _ = _captured(helpers, "sgd")
    monkeypatch.setattr(_ops, "fbgemm_has_cuda", lambda: False)
    assert default_backend("gpu", "cuda") == "in_graph"
    with pytest.raises(
        ConfigError, match="fbgemm' on CUDA needs FBGEMM's CUDA kernels.*recir-embedding\\[fbgemm-gpu\\]"
    ):
        prepare_for_lowering(step, backend="fbgemm", target="gpu", device="cuda")
    monkeypatch.setattr(_ops, "fbgemm_has_cuda", lambda: True)
    assert default_backend("gpu", "cuda") == "fbgemm"
    assert default_backend("gpu", "cpu") == "in_graph"


def test_keep_checks_overrides_the_default(helpers):
    _, _, step, _ = _captured(helpers, "sgd")

    def n_checks(s):
        return sum("check_jagged" in str(n.target) for n in s.graph.nodes)

    assert n_checks(prepare_for_lowering(step, backend="in_graph", target="gpu", keep_checks=False)) == 0
    kept = prepare_for_lowering(step, target="tpu", keep_checks=True)
    assert n_checks(kept) == 2 and kept.meta["recir.embedding"]["checks_removed"] == 0
