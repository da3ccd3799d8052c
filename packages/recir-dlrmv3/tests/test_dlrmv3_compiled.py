"""The compiled targets: `train --target tpu|gpu` compiles once and trains; `parity` matches eager
parameters and optimizer state step by step, and fails past its tolerance."""

import dataclasses
import math
import re

import pytest
import torch
from _dlrmv3_events import run_dirs, scalars
from _dlrmv3_output import messages
from recir.dlrmv3 import TrainOptions, train
from recir.dlrmv3._cli import main

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_eval_batches=2, num_threads=1)  # fmt: skip
FLAGS = [f"--{k}={v}" for k, v in TINY.items() if k != "num_eval_batches"]


@pytest.mark.smoke
@pytest.mark.tpu
def test_dlrmv3_tpu_target_compiles_once_trains_and_resumes(tmp_path):
    lines: list[str] = []
    # Dropout on: capture's counter-based RNG lives in the rng:* state slots, so resume is exact.
    opts = TrainOptions(**TINY, target="tpu", num_train_batches=4, log_every=1, checkpoint_dir=str(tmp_path),
                        checkpoint_every=2)  # fmt: skip
    result = train(opts, log=lines.append)
    assert sum("compiled in" in x for x in lines) == 1
    compiled_line = [x for x in lines if "compiled in" in x][0]
    assert compiled_line.startswith("train step compiled in ")
    assert re.search(r"; capture \d+\.\d\ds, trace \d+\.\d\ds, XLA -?\d+\.\d\ds$", compiled_line), (
        compiled_line
    )
    assert "recir.lower_tpu" in lines[0]
    assert result.compile_seconds > 0 and len(result.losses) == 4
    assert all(math.isfinite(v) for v in result.losses + list(result.metrics.values()))
    # the StepGraph state (slot names) round-trips through the DCP checkpoint of step 2
    resumed = train(
        dataclasses.replace(opts, resume=str(tmp_path / "step-2"), checkpoint_every=0), log=lambda _: None
    )
    assert resumed.start_step == 2 and resumed.losses == result.losses[2:]


@pytest.mark.tpu
def test_dlrmv3_parity_tpu(capsys):
    assert main(["parity", "--target", "tpu", "--steps", "3", *FLAGS]) == 0
    out = capsys.readouterr().out
    assert "parity OK" in out and "compared" in out
    rows = [line.split() for line in messages(out) if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(float(r[3]) < 1e-5 and float(r[4]) < 1e-4 and float(r[5]) < 1e-4 for r in rows)
    # the same run past a tolerance no float32 path meets exits non-zero
    assert main(["parity", "--target", "tpu", "--steps", "1", "--atol", "1e-12", *FLAGS]) == 1
    assert "parity FAILED" in capsys.readouterr().out


@pytest.mark.tpu
def test_dlrmv3_parity_tpu_with_packed_tokens(capsys):
    # 36 token rows for 4 x (2 + 8 + 3) = 52 slots: the STU layers run on the packed rows (the longest
    # histories of a batch over the budget lose their oldest events on both sides alike)
    assert main(["parity", "--target", "tpu", "--steps", "2", "--token_budget", "36", *FLAGS]) == 0
    assert "parity OK" in capsys.readouterr().out


def _token_buckets_train_one_state(target: str, device: str, atol: float) -> None:
    # three budgets: a compiled step each, one state through them all, equal to the unpacked run (the
    # batches here all fit their buckets, so nothing is trimmed). Batches go to `device` before the step,
    # as the benchmark's and a CUDA user's loop do; the model (and so each budget's capture) stays on the CPU.
    from recir.dlrmv3._train import build
    from recir.dlrmv3._trainers import BucketedTrainer, make_trainer

    sizes = dict(TINY, batch_size=8, uih_len=32, input_dropout=0.0, layer_dropout=0.0)
    states, rows = [], []
    for extra in ({}, dict(token_budget="auto", token_buckets=3)):
        opts = TrainOptions(**sizes, target=target, **extra)  # type: ignore[arg-type]
        model, data, optimizers = build(opts)
        trainer = make_trainer(
            target, model, optimizers, data.train_batch(0), token_buckets=data.token_buckets
        )
        for step in range(10):
            batch = data.train_batch(step)
            rows.append(int(batch.token_index.shape[0]))
            trainer.step(batch.to(device))
        states.append(trainer.state_dict())
    assert isinstance(trainer, BucketedTrainer) and sorted(trainer.by_rows) == sorted(set(rows[10:]))
    assert len(trainer.by_rows) == 3 and max(rows[10:]) < rows[0]  # three budgets, all below the slots
    for name, value in states[0].items():  # parameters and optimizer state
        assert value.dtype == states[1][name].dtype
        if value.is_floating_point():
            torch.testing.assert_close(states[1][name].cpu(), value.cpu(), rtol=0, atol=atol, msg=name)


@pytest.mark.tpu
def test_dlrmv3_tpu_token_buckets_compile_once_per_budget_and_train_one_state():
    _token_buckets_train_one_state("tpu", "cpu", atol=1e-6)


@pytest.mark.gpu
def test_dlrmv3_gpu_token_buckets_on_cuda_batches_train_one_state():
    # CUDA kernels of other shapes sum in other orders than the unpacked step's: a looser bound than the TPU
    # path's on the CPU
    _token_buckets_train_one_state("gpu", "cuda", atol=1e-5)


def _gpu_path_parity(capsys, backend: str | None, *extra: str) -> str:  # type: ignore[no-untyped-def]
    args = ["parity", "--target", "gpu", "--steps", "2", *FLAGS, *extra]
    if backend:
        args += ["--embedding_backend", backend]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "parity OK" in out
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["in_graph", "fbgemm"])
def test_dlrmv3_parity_gpu_on_cuda(capsys, backend):
    from recir.embedding._ops import fbgemm_has_cuda

    if backend == "fbgemm" and not fbgemm_has_cuda():
        pytest.skip(
            "FBGEMM without CUDA kernels is installed (fbgemm-gpu-cpu); the fbgemm backend needs fbgemm-gpu"
        )
    _gpu_path_parity(capsys, backend)


@pytest.mark.slow
def test_dlrmv3_parity_gpu_path_on_cpu(capsys):
    # The GPU path (Inductor) on the CPU device: one cold compile of the tiny step takes about a minute
    # on 2 cores (seconds with a warm cache), so this runs in CI.
    _gpu_path_parity(capsys, None)


@pytest.mark.slow
def test_dlrmv3_parity_gpu_path_on_cpu_with_packed_tokens(capsys):
    _gpu_path_parity(capsys, None, "--token_budget", "36")


@pytest.mark.slow
def test_dlrmv3_parity_gpu_path_fused_fbgemm_tbe_on_cpu(capsys):
    # --embedding_backend fbgemm: FBGEMM's split TBE (fbgemm-gpu-cpu's kernels here) looks up the sequence
    # features (pooling NONE) and trains the tables with its fused row-wise Adagrad outside the graph.
    pytest.importorskip("fbgemm_gpu")
    out = _gpu_path_parity(capsys, "fbgemm")
    assert "table(s) trained by FBGEMM's TBE, fused optimizer" in out


@pytest.mark.slow
def test_dlrmv3_gpu_target_trains(tmp_path):
    # The GPU path end to end: Inductor on CUDA when present, else on the CPU device. Same flags, optimizer
    # and (no) dropout as the parity run above, so on the CPU the Inductor graph cache serves this compile.
    lines: list[str] = []
    opts = TrainOptions(**TINY, target="gpu", num_train_batches=4, log_every=1, input_dropout=0.0,
                        layer_dropout=0.0, optimizer="adagrad", tensorboard_dir=str(tmp_path / "tb"))  # fmt: skip
    result = train(opts, log=lines.append)
    assert sum("compiled in" in x for x in lines) == 1
    assert "recir.lower_gpu" in [x for x in lines if "compiled in" in x][0]
    assert len(result.losses) == 4
    assert all(math.isfinite(v) for v in result.losses + list(result.metrics.values()))
    (run,) = run_dirs(tmp_path / "tb")
    tb = scalars(run)
    assert [v for _, v in tb["train/loss"]] == pytest.approx(result.losses, rel=1e-6)
    assert {k: v for k, ((_, v),) in ((k, tb[f"eval/{k}"]) for k in result.metrics)} == pytest.approx(
        result.metrics, rel=1e-6
    )


@pytest.mark.tpu
def test_dlrmv3_tpu_trainer_releases_the_models_copy_and_shows_the_trained_arrays():
    # On the one-device TPU path the weights live in JAX: the model's parameters are placeholders on
    # untouched pages while it trains; sync_model() makes them views of the trained arrays (no copy),
    # and the next step releases them again, so it still updates its state in place.
    import jax
    from recir.dlrmv3._train import build
    from recir.dlrmv3._trainers import make_trainer

    opts = TrainOptions(**TINY, target="tpu")
    model, data, optimizers = build(opts)
    params = dict(model.named_parameters())
    before = {k: p.detach().clone() for k, p in params.items()}
    trainer = make_trainer("tpu", model, optimizers, data.train_batch(0))
    assert trainer.released is not None and set(trainer.released.placeholders) == set(params)
    assert all(not p.detach().any() for p in params.values())  # released: zero pages, not the weights
    assert dict(model.named_parameters()) == params  # the same Parameter objects (the optimizers' own)
    trainer.step(data.train_batch(0))
    trained = trainer.sync_model()
    state = trainer.state_dict()
    on_host = jax.default_backend() == "cpu"
    slots = {s.name: x for s, x in zip(trainer.compiled.step.signature.state, trainer.state)}
    for name, p in params.items():
        assert torch.equal(p.detach(), state[f"param:{name}"]), name
        if on_host:  # a view, not a copy (a TPU's arrays are in its memory: the model gets host copies)
            assert p.data_ptr() == slots[f"param:{name}"].unsafe_buffer_pointer(), name
    assert trained is model and any(not torch.equal(before[k], p.detach()) for k, p in params.items())
    buffers = [x.unsafe_buffer_pointer() for x in trainer.state]
    trainer.step(data.train_batch(1))  # releases the views first: the step still donates in place
    assert [x.unsafe_buffer_pointer() for x in trainer.state] == buffers
    assert all(not p.detach().any() for p in params.values())
    trainer.sync_model()
    trainer.load_state_dict({k: v.clone() for k, v in state.items()})  # new arrays: views dropped
    assert all(not p.detach().any() for p in params.values())


def test_dlrmv3_gpu_trainer_trains_the_model_itself():
    # The GPU path's in-place step takes the model's own tensors as its state (one copy of the weights in
    # the process): the model shows the trained values without a sync, also after a checkpoint load.
    from recir.dlrmv3._train import build
    from recir.dlrmv3._trainers import make_trainer

    opts = TrainOptions(**TINY, target="gpu", input_dropout=0.0, layer_dropout=0.0)
    model, data, optimizers = build(opts)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = make_trainer("gpu", model, optimizers, data.train_batch(0))
    for step in range(2):
        trainer.step(data.train_batch(step))
    state = trainer.state_dict()
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert p.data_ptr() == state[f"param:{name}"].data_ptr(), name  # shared, not copied
    assert any(not torch.equal(before[k], p.detach()) for k, p in params.items())  # and trained
    snapshot = {k: v.clone() for k, v in state.items()}
    trainer.load_state_dict(snapshot)  # copies into new state tensors: the model follows them
    state = trainer.state_dict()
    for name, p in params.items():
        assert p.data_ptr() == state[f"param:{name}"].data_ptr() != snapshot[f"param:{name}"].data_ptr(), name
        assert torch.equal(p.detach(), snapshot[f"param:{name}"]), name
