"""`--table_dtype fp16|bf16`: the embedding tables stored in half the bytes (recir-embed-table-dtype on the
captured step), trained the same on the StepGraph interpreter and both compiled paths. (The default debug
run's AUC with bf16 tables: test_dlrmv3_precision.py.)"""

from __future__ import annotations

import pytest
import torch
from _dlrmv3_output import messages
from recir.dlrmv3 import TrainOptions
from recir.dlrmv3._cli import main
from recir.dlrmv3._parity import run_parity
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer
from recir.transforms import ConfigError

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip
TABLES = ("post_id", "viewer_id", "dummy_contextual")


def _trained(target: str, table_dtype: str, steps: int = 3) -> tuple[dict[str, torch.Tensor], list[float]]:
    opts = TrainOptions(**TINY, target=target, table_dtype=table_dtype)
    model, data, optimizers = build(opts)
    trainer = make_trainer(target, model, optimizers, data.train_batch(0), table_dtype=table_dtype)
    losses = [float(trainer.step(data.train_batch(i))[0]) for i in range(steps)]
    return trainer.state_dict(), losses


@pytest.mark.slow
def test_dlrmv3_fp16_tables_train_alike_on_every_captured_target():
    base, base_losses = _trained("eager-graph", "fp16")
    fp32, fp32_losses = _trained("eager-graph", "fp32")
    for name in (f"param:ec.embeddings.{t}.weight" for t in TABLES):
        assert base[name].dtype == torch.float16 and fp32[name].dtype == torch.float32
        assert base[f"optim:{name[6:]}:sum"].dtype == torch.float32  # row-wise Adagrad's state stays fp32
        # fp16's spacing below 0.5 is at most 2**-12: init and three updates, each rounded once
        assert (base[name].float() - fp32[name]).abs().max() <= 4 * 2**-12, name
    for target in ("tpu", "gpu"):
        state, losses = _trained(target, "fp16")
        assert state.keys() == base.keys()
        for name, value in state.items():
            assert value.dtype == base[name].dtype, name
            # the same float32 updates rounded with the same bits: at most one unit apart where the
            # compiled sums differ in their last bit
            unit = 2**-11 if value.dtype == torch.float16 else 1e-4
            torch.testing.assert_close(value.float(), base[name].float(), rtol=1e-3, atol=unit, msg=name)
        assert max(abs(a - b) for a, b in zip(losses, base_losses)) < 1e-4
    assert max(abs(a - b) for a, b in zip(base_losses, fp32_losses)) < 1e-2


def test_dlrmv3_table_dtype_flags(capsys):
    opts = TrainOptions(**TINY, target="eager-graph", table_dtype="bf16")
    model, data, optimizers = build(opts)
    trainer = make_trainer("eager-graph", model, optimizers, data.train_batch(0), table_dtype="bf16")
    assert "--table_dtype bf16: 3 table(s)" in trainer.description
    slots = {s.name: s.dtype for s in trainer.graph.signature.state}
    assert [slots[f"param:ec.embeddings.{t}.weight"] for t in TABLES] == [torch.bfloat16] * 3
    assert slots["param:position_emb"] == torch.float32  # a dense parameter, not a table
    with pytest.raises(ConfigError, match="--table_dtype 'fp8'"):
        TrainOptions(table_dtype="fp8").check()
    with pytest.raises(ConfigError, match="--target eager has none.*Fix"):
        TrainOptions(target="eager", table_dtype="fp16").check()
    with pytest.raises(ConfigError, match="--embedding_backend torchrec.*Fix: --embedding_backend in_graph"):
        TrainOptions(target="gpu", table_dtype="fp16", embedding_backend="torchrec").check()
    for parallel in ("hybrid", "fsdp", "auto"):  # torch.distributed's table sharding: fp32 tables only
        with pytest.raises(ConfigError, match=f"--parallel {parallel}: .*Fix: --parallel dp"):
            TrainOptions(target="gpu", table_dtype="fp16", parallel=parallel).check()
    TrainOptions(target="gpu", table_dtype="fp16", parallel="dp").check()
    with pytest.raises(
        ConfigError, match="--precision bf16, --table_dtype fp16 change the step's maths.*Fix"
    ):
        run_parity(TrainOptions(**TINY, target="tpu", precision="bf16", table_dtype="fp16"), steps=1)
    with pytest.raises(SystemExit) as info:
        main(["train", "--table_dtype", "int8"])
    assert info.value.code == 2 and "--table_dtype" in capsys.readouterr().err


def test_dlrmv3_resume_converts_tables_saved_in_another_table_dtype(tmp_path, capsys):
    """A checkpoint's tables load into a run that stores them in another --table_dtype: widened exactly
    (the resumed step computes the loss the fp16 run computes) or rounded, each conversion logged."""
    flags = [f"--{k}={v}" for k, v in {**TINY, "num_eval_batches": 1, "log_every": 1}.items()]
    flags += ["--target=eager-graph", "--input_dropout=0", "--layer_dropout=0"]

    def train(ckpt: str, steps: int, table_dtype: str, *extra: str) -> list[str]:
        args = ["train", *flags, f"--num_train_batches={steps}", "--checkpoint_every=2"]
        assert (
            main([*args, f"--checkpoint_dir={tmp_path / ckpt}", f"--table_dtype={table_dtype}", *extra]) == 0
        )
        return [x for x in messages(capsys.readouterr().out) if x.startswith(("epoch", "--resume"))]

    def losses(lines: list[str]) -> list[float]:
        return [float(x.split()[5]) for x in lines if x.startswith("epoch")]

    straight = losses(train("fp16", 3, "fp16"))
    train("half", 2, "fp16")
    resumed = train("half", 3, "fp32", "--resume")
    assert [x for x in resumed if x.startswith("--resume")] == [
        f"--resume: param:ec.embeddings.{t}.weight saved as float16, this run stores it as float32 (widened exactly)"
        for t in sorted(TABLES)  # slot-name order
    ]
    assert losses(resumed) == pytest.approx(straight[2:], rel=1e-6)
    train("full", 2, "fp32")
    rounded = train("full", 3, "bf16", "--resume")
    assert (
        sum("saved as float32, this run stores it as bfloat16 (rounded to nearest)" in x for x in rounded)
        == 3
    )
