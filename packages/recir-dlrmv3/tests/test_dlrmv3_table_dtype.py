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
    with pytest.raises(
        ConfigError, match="--parallel fsdp and no --table_sharding: .*Fix: --table_sharding row"
    ):
        TrainOptions(target="gpu", table_dtype="fp16", parallel="fsdp").check()
    for parallel in ("dp", "hybrid", "auto"):  # tables replicated, or sharded by recir-dist-shard-tables
        TrainOptions(target="gpu", table_dtype="fp16", parallel=parallel).check()
    TrainOptions(target="gpu", table_dtype="fp16", parallel="fsdp", table_sharding="row").check()
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


def test_dlrmv3_fp16_tables_sharded_row_wise_over_two_ranks(tmp_path):
    """`--parallel hybrid --table_sharding row --table_dtype fp16` under 2 gloo ranks (the GPU path's per-rank
    programs, interpreted): each rank stores its rows of every table fp16 (recir-embed-table-dtype after
    recir.distributed.distribute, rounding with the whole table's bits) and trains like one fp16 process:
    losses, the tables in the checkpoint (fp16, gathered), their optimizer state and the dense parameters."""
    import json
    import math
    import socket

    import torch.multiprocessing as mp
    from _dlrmv3_workers import VARIED, run_rank_modes
    from recir.dlrmv3 import load_checkpoint, train

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_rank_modes, args=(2, port, str(tmp_path), ["hybrid"], "row", "fp16"), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"modes-rank{r}.json").read_text())["hybrid"] for r in range(2)]
    assert any("row_wise" in x and "--table_dtype fp16: 3 table(s)" in x for x in ranks[0]["lines"]), ranks[0]
    one = train(
        TrainOptions(
            target="eager-graph", table_dtype="fp16", **dict(VARIED, checkpoint_dir=str(tmp_path / "one"))
        ),  # type: ignore[arg-type]
        log=lambda _: None,
    )
    for r in ranks:
        assert all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) for a, b in zip(r["losses"], one.losses))
    last = f"step-{VARIED['num_train_batches']}"
    got, _ = load_checkpoint(tmp_path / "hybrid" / last)
    want, _ = load_checkpoint(tmp_path / "one" / last)
    compared = 0
    for key, value in want.items():
        if not key.startswith(("param:", "optim:")) or got[key].shape != value.shape:
            continue  # eager-graph's shared Adam step count has the same layout on both sides; kept for safety
        assert got[key].dtype == value.dtype, key
        if value.dtype == torch.float16:
            # the same float32 updates rounded with the same bits, where the ranks' sums (all-to-alls, the
            # data-parallel mean) leave the float32 value on the same side of the rounding: otherwise one unit
            torch.testing.assert_close(got[key].float(), value.float(), rtol=0, atol=2**-11, msg=key)
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-6, msg=key)
        compared += 1
    tables = [k for k in want if k.startswith("param:ec.embeddings.")]
    assert len(tables) == 3 and all(want[k].dtype == torch.float16 for k in tables)
    assert compared > 3 * len(tables)
