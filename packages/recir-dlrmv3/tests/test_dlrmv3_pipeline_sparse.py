"""`train --pipeline_sparse STAGES`: recir-pipeline-sparse on the captured step; the batches after the current
one go to the step as a look-ahead, and each step still trains (and reports) the batch it is given."""

from __future__ import annotations

import pytest
from recir.dlrmv3 import TrainOptions, load_checkpoint, train
from recir.dlrmv3._cli import main
from recir.transforms import ConfigError

TINY = dict(batch_size=4, embedding_dim=16, num_layers=2, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1, num_train_batches=5, num_eval_batches=2)  # fmt: skip


@pytest.mark.parametrize("stages", [2, 3])
def test_pipelined_training_equals_unpipelined_training(tmp_path, stages):
    lines: list[str] = []
    plain = train(TrainOptions(target="eager-graph", **TINY), log=lambda _: None)  # type: ignore[arg-type]
    piped = train(
        TrainOptions(
            target="eager-graph",
            pipeline_sparse=stages,
            checkpoint_dir=str(tmp_path),
            checkpoint_every=2,
            **TINY,  # type: ignore[arg-type]
        ),
        log=lines.append,
    )
    assert any(f"--pipeline_sparse {stages}: " in line and "node(s) ahead" in line for line in lines), lines
    assert piped.losses == plain.losses  # bit for bit: each step trains the batch it was given
    assert piped.metrics == pytest.approx(plain.metrics, nan_ok=True)
    state, _ = load_checkpoint(tmp_path / "step-4")
    assert state and not any(name.startswith("carry:") for name in state)  # carries are not training state
    # a resumed pipelined run refills its carries and ends where the uninterrupted one did
    resumed = train(
        TrainOptions(target="eager-graph", pipeline_sparse=stages, resume=str(tmp_path / "step-2"), **TINY),  # type: ignore[arg-type]
        log=lambda _: None,
    )
    assert resumed.losses == plain.losses[2:]


def test_bad_pipeline_sparse_flags_say_what_to_pass(capsys):
    with pytest.raises(ConfigError, match="--pipeline_sparse 1: expected 0"):
        TrainOptions(pipeline_sparse=1).check()
    with pytest.raises(ConfigError, match="not with --target eager"):
        TrainOptions(target="eager", pipeline_sparse=2).check()
    with pytest.raises(ConfigError, match="--token_buckets 2"):
        TrainOptions(target="tpu", pipeline_sparse=2, token_budget="auto", token_buckets=2).check()
    with pytest.raises(SystemExit) as info:
        main(["train", "--pipeline_sparse", "two"])
    assert info.value.code == 2 and "--pipeline_sparse" in capsys.readouterr().err


def test_pipelined_training_on_the_gpu_path_matches_the_interpreter():
    plain = train(TrainOptions(target="eager-graph", **TINY), log=lambda _: None)  # type: ignore[arg-type]
    lines: list[str] = []
    piped = train(TrainOptions(target="gpu", pipeline_sparse=2, **TINY), log=lines.append)  # type: ignore[arg-type]
    assert any("recir.lower_gpu.compile" in line and "--pipeline_sparse 2: " in line for line in lines), lines
    assert piped.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-6)
