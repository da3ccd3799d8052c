"""`--mask_padding` (recir-embed-mask-padding on the captured step): DLRMv3's KJT lookups already send
their padding to zero rows, so the transform marks the jagged feature, rewrites nothing and the run trains
bit for bit as without it; the start line says so. Not on --target eager (no captured step)."""

from __future__ import annotations

import pytest
import torch
from recir.dlrmv3 import TrainOptions
from recir.dlrmv3._cli import main
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer
from recir.transforms import ConfigError

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip


def _trained(mask_padding: bool):  # type: ignore[no-untyped-def]
    opts = TrainOptions(**TINY, target="eager-graph", mask_padding=mask_padding)
    model, data, optimizers = build(opts)
    trainer = make_trainer("eager-graph", model, optimizers, data.train_batch(0), mask_padding=mask_padding)
    losses = [float(trainer.step(data.train_batch(i))[0]) for i in range(3)]
    return trainer, losses, trainer.state_dict()


def test_dlrmv3_mask_padding_finds_the_kjt_padding_masked_and_trains_the_same():
    base, losses, state = _trained(False)
    trainer, other_losses, other = _trained(True)
    assert "--mask_padding: 1 jagged feature(s), 0 lookup(s) masked (the KJT path already masks" in (
        trainer.description
    )
    assert "--mask_padding" not in base.description
    assert other_losses == losses
    for name, value in state.items():  # parameters and optimizer state
        assert torch.equal(value, other[name]), name


def test_dlrmv3_mask_padding_needs_a_captured_step(capsys):
    with pytest.raises(ConfigError, match="--mask_padding rewrites the captured step"):
        TrainOptions(target="eager", mask_padding=True).check()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--mask_padding" in capsys.readouterr().out
