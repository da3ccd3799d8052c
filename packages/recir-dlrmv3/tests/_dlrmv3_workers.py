"""The per-rank body of the 2-process `train --parallel` test (spawned processes import it by name)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from recir.dlrmv3 import TrainOptions, train

SMALL = dict(
    batch_size=8,
    num_train_batches=4,
    num_candidates=1,
    input_dropout=0.0,
    layer_dropout=0.0,
    num_eval_batches=2,
    log_every=1,
    embedding_dim=16,
    uih_len=8,
)


def run_rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        lines: list[str] = []
        opts = TrainOptions(
            target="eager-graph",
            parallel="hybrid",
            checkpoint_dir=str(Path(out) / "ckpt"),
            checkpoint_every=2,
            **SMALL,  # type: ignore[arg-type]
        )
        result = train(opts, log=lines.append)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"losses": result.losses, "lines": lines}))
    finally:
        dist.destroy_process_group()


# Several candidates per sample: the ranks' halves of a global batch hold different candidate counts and
# longest sequences, which the global normalisation (Batch.loss_norm / max_seq_len) must absorb.
# Seed 1: they differ in steps 1 and 2. Checkpoints every 2 steps (a resume point and the final state).
VARIED = dict(SMALL, num_candidates=4, seed=1, checkpoint_every=2)


def run_rank_modes(rank: int, world: int, port: int, out: str, modes: list[str]) -> None:
    """`train --target eager-graph --parallel MODE` (VARIED) for each mode in one process group, each run
    checkpointing under out/MODE; losses and log lines go to out/modes-rank{rank}.json."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        found: dict[str, dict[str, list]] = {}
        for mode in modes:
            lines: list[str] = []
            opts = TrainOptions(
                target="eager-graph",
                parallel=mode,
                checkpoint_dir=str(Path(out) / mode),
                **VARIED,  # type: ignore[arg-type]
            )
            found[mode] = {"losses": train(opts, log=lines.append).losses, "lines": lines}
        Path(out, f"modes-rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()
