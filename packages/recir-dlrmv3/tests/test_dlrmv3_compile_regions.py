"""`--compile_regions repeated` (the GPU path compiles each STU layer's code once): parity with eager,
and the packed layers' nodes carry their layer's module scope (what the regions are cut by)."""

from __future__ import annotations

import pytest
from recir.dlrmv3 import TrainOptions
from recir.dlrmv3._cli import main
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer
from recir.transforms import PHASE_KEY, SCOPE_KEY, ConfigError

TINY = dict(batch_size=4, embedding_dim=16, num_layers=2, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip
FLAGS = [f"--{k}={v}" for k, v in TINY.items()]


def test_packed_layers_are_scoped_by_their_module():
    # token packing runs STULayer.forward_packed: called through the module, so capture sees the layer
    opts = TrainOptions(**{**TINY, "uih_len": 32}, target="eager-graph", token_budget="auto")
    model, data, optimizers = build(opts)
    assert data.train_batch(0).packed  # (at UIH 8 the budget holds every slot: nothing to pack)
    trainer = make_trainer("eager-graph", model, optimizers, data.train_batch(0))
    forward = [n for n in trainer.graph.graph.nodes if n.meta.get(PHASE_KEY) == "forward"]
    own = {i: sum(1 for n in forward if n.meta.get(SCOPE_KEY) == f"layers.{i}") for i in range(2)}
    # the layer's own ops (silu, the q/k/v scatter into [B, H, N, A], the attention, the gather back)
    assert min(own.values()) >= 10, own


@pytest.mark.slow
def test_dlrmv3_compile_regions_parity_gpu_path_on_cpu(capsys):
    argv = [
        "parity",
        "--target",
        "gpu",
        "--steps",
        "2",
        "--compile_regions",
        "repeated",
        "--token_budget",
        "auto",
    ]
    assert main([*argv, *FLAGS, "--uih_len=32"]) == 0  # packed batches (see above)
    assert "parity OK" in capsys.readouterr().out


def test_dlrmv3_bad_compile_regions():
    with pytest.raises(ConfigError, match="unknown --compile_regions 'layers'"):
        TrainOptions(compile_regions="layers").check()
    with pytest.raises(ConfigError, match="GPU path's flag"):
        TrainOptions(target="tpu", compile_regions="repeated").check()


def test_compile_regions_auto_is_repeated_only_where_it_was_measured_to_pay(monkeypatch):
    import torch
    from recir.dlrmv3._config import REGIONS_FROM_LAYERS
    from recir.dlrmv3._train import gpu_options, resolve_compile_regions

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    deep = {**TINY, "num_layers": REGIONS_FROM_LAYERS}
    assert TrainOptions().compile_regions == "auto"
    assert resolve_compile_regions(TrainOptions(**deep, target="gpu")) == "repeated"
    assert gpu_options(TrainOptions(**deep, target="gpu")).regions == "repeated"  # type: ignore[attr-defined]
    assert resolve_compile_regions(TrainOptions(**deep, target="gpu", compile_regions="whole")) == "whole"
    # the model's own recomputation (inside each layer) keeps the layers alike: compiled once each
    assert resolve_compile_regions(TrainOptions(**deep, target="gpu", recompute="attention")) == "repeated"
    for other in (
        dict(num_layers=REGIONS_FROM_LAYERS - 1),  # few layers: the pieces' own overhead is not repaid
        dict(parallel="dp"),
        dict(recompute="layers"),
        dict(recompute="auto"),
        dict(pipeline_sparse=2),
        dict(cuda_graphs=True),
        dict(target="tpu"),
    ):
        opts = TrainOptions(**{**deep, "target": "gpu", **other})  # type: ignore[arg-type]
        assert resolve_compile_regions(opts) == "whole", other
    assert gpu_options(TrainOptions(**TINY, target="gpu")) is None  # the lowering's defaults
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # not measured on CUDA: whole
    assert resolve_compile_regions(TrainOptions(**deep, target="gpu")) == "whole"
    TrainOptions(**deep, target="tpu").check()  # auto is every target's default: no error
