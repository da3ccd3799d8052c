"""`--recompute none|layers|auto|attention` (recir-recompute-activations on the captured step, or the STU
attention's own recomputed scores): bit-exact on the interpreter, parity on both compiled paths, less memory
where the backend keeps the copies apart."""

from __future__ import annotations

import pytest
import torch
from recir.dlrmv3 import TrainOptions
from recir.dlrmv3._cli import main
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer
from recir.transforms import RECOMPUTE_KEY, ConfigError, transient_peak_bytes

TINY = dict(batch_size=4, embedding_dim=16, num_layers=2, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip
FLAGS = [f"--{k}={v}" for k, v in TINY.items()]
_BARRIER = torch.ops.recir.recompute_barrier.default
_ATTENTION_BWD = torch.ops.recir.hstu_attention_backward.default


def _trained(target: str, recompute: str, steps: int = 3, **sizes):  # type: ignore[no-untyped-def]
    opts = TrainOptions(**{**TINY, **sizes}, target=target, recompute=recompute)
    model, data, optimizers = build(opts)
    trainer = make_trainer(target, model, optimizers, data.train_batch(0), recompute=recompute)
    losses = [float(trainer.step(data.train_batch(i))[0]) for i in range(steps)]
    return trainer, losses, trainer.state_dict()


def test_dlrmv3_recompute_is_bit_exact_on_the_interpreter():
    # dropout on: the copies reuse the forward's keep masks (never redrawn), so even that is bit-equal
    base, losses, state = _trained("eager-graph", "none")
    for mode in ("layers", "auto"):
        trainer, other_losses, other = _trained("eager-graph", mode)
        copies = [n for n in trainer.graph.graph.nodes if RECOMPUTE_KEY in n.meta]
        assert copies and all(n.meta["recir.phase"] == "backward" for n in copies)
        assert transient_peak_bytes(trainer.graph) <= transient_peak_bytes(base.graph)
        assert other_losses == losses
        assert state.keys() == other.keys()
        for name, value in state.items():  # parameters, Adam/Adagrad state, rng offsets
            assert torch.equal(value, other[name]), (mode, name)
    trainer = _trained("eager-graph", "layers", steps=0)[0]
    assert "--recompute layers: 2 region(s), interpreter peak" in trainer.description  # train logs it
    layers = trainer.graph
    barriers = [n for n in layers.graph.nodes if n.target is _BARRIER]
    assert sorted(n.meta[RECOMPUTE_KEY] for n in barriers) == ["layers.0", "layers.1"]


@pytest.mark.tpu
def test_dlrmv3_recompute_on_the_tpu_path_matches_and_needs_less_memory():
    # layers: attention scores dominate the activations; the last layer computes its candidates only.
    # attention: each STU attention is recir::hstu_attention, whose backward op recomputes its scores
    # (in its JAX lowering behind recompute_barrier's fence: without it XLA's CSE merges them with the
    # forward's and keeps them after all), one per layer but the last, which computes its candidates
    # only (STULayer.forward_candidates)
    import jax

    sizes = dict(uih_len=128, embedding_dim=32, num_layers=3)
    base, losses, state = _trained("tpu", "none", steps=2, **sizes)
    for mode, fence, barriers, bound in (("layers", _BARRIER, 3, 0.8), ("attention", _ATTENTION_BWD, 2, 0.9)):
        trainer, other_losses, other = _trained("tpu", mode, steps=2, **sizes)
        assert sum(n.target is fence for n in trainer.graph.graph.nodes) == barriers, mode
        assert other_losses == pytest.approx(losses, rel=1e-6, abs=1e-7)
        for name, value in state.items():  # optimizer state within 1e-6, parameters within 1e-5:
            # Adam divides each gradient by its own root mean square, so a near-zero entry whose sum
            # order changed moves its weight by more than the gradient's rounding (seen: 1.7e-6 on an
            # AVX-512 Xeon, one entry of 4096)
            atol = 1e-5 if name.startswith("param:") else 1e-6
            torch.testing.assert_close(other[name], value, rtol=0, atol=atol, msg=f"{mode} {name}")
        # XLA's own accounting of the step's temporary buffers: its CSE did not fold the copies back.
        # JAX's CPU backend only: a TPU's compiler schedules and rematerialises for its own memory, and
        # on a v5e these tiny shapes' temporaries (padded to its 8 x 128 tiles) came out equal with and
        # without (layers: 16,644,096 against 16,386,048 bytes)
        temp = [t.compiled._compiled.memory_analysis().temp_size_in_bytes for t in (base, trainer)]
        assert jax.default_backend() != "cpu" or temp[1] < bound * temp[0], (mode, temp)


@pytest.mark.slow
def test_dlrmv3_recompute_attention_parity_gpu_path_on_cpu(capsys):
    # 4 layers: --compile_regions auto compiles each layer once (repeated), as for the full-size model
    flags = [*FLAGS, "--num_layers=4"]
    assert main(["parity", "--target", "gpu", "--steps", "2", "--recompute", "attention", *flags]) == 0
    out = capsys.readouterr().out
    assert "--compile_regions repeated" in out and "parity OK" in out


@pytest.mark.slow
def test_dlrmv3_recompute_parity_gpu_path_on_cpu(capsys):
    assert main(["parity", "--target", "gpu", "--steps", "2", "--recompute", "layers", *FLAGS]) == 0
    assert "parity OK" in capsys.readouterr().out


def test_dlrmv3_bad_recompute(capsys):
    with pytest.raises(ConfigError, match="unknown --recompute 'all'"):
        TrainOptions(recompute="all").check()
    with pytest.raises(ConfigError, match="--target eager has none"):
        TrainOptions(target="eager", recompute="layers").check()
    TrainOptions(target="eager", recompute="attention").check()  # the model's own: eager runs it too
    with pytest.raises(SystemExit) as info:
        main(["train", "--recompute", "all"])
    assert info.value.code == 2 and "--recompute" in capsys.readouterr().err
