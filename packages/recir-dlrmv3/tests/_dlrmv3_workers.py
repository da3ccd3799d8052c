"""Shared test helpers: the per-rank body of the 2-process `train --parallel` test (spawned processes
import it by name), random samples, and the comparison of a launched run with one eager process."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

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


# Several candidates per sample: the ranks' halves of a global batch hold different candidate counts and
# longest sequences, which the global normalisation (Batch.loss_norm / max_seq_len) must absorb.
# Seed 1: they differ in steps 1 and 2. Checkpoints every 2 steps (a resume point and the final state).
VARIED = dict(SMALL, num_candidates=4, seed=1, checkpoint_every=2)


def run_rank_modes(
    rank: int,
    world: int,
    port: int,
    out: str,
    modes: list[str],
    table_sharding: str | None = None,
    table_dtype: str = "fp32",
) -> None:
    """`train --target eager-graph --parallel MODE [--table_sharding S] [--table_dtype D]` (VARIED) for each
    mode in one process group, each run checkpointing under out/MODE; losses and log lines go to
    out/modes-rank{rank}.json. A mode ``hybrid:layers`` adds ``--recompute layers``, ``hybrid:pipeline``
    ``--pipeline_sparse 2``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        found: dict[str, dict[str, list]] = {}
        for mode in modes:
            lines: list[str] = []
            parallel, _, extra = mode.partition(":")
            opts = TrainOptions(
                target="eager-graph",
                parallel=parallel,
                recompute=extra if extra in ("layers", "auto") else "none",
                pipeline_sparse=2 if extra == "pipeline" else 0,
                table_sharding=table_sharding,
                table_dtype=table_dtype,
                checkpoint_dir=str(Path(out) / mode),
                **VARIED,  # type: ignore[arg-type]
            )
            found[mode] = {"losses": train(opts, log=lines.append).losses, "lines": lines}
        Path(out, f"modes-rank{rank}.json").write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def random_samples(n: int, seed: int = 0, max_uih: int = 6, max_cand: int = 3) -> list[Any]:
    """`n` jagged samples with 1..max_uih UIH events and 1..max_cand candidates each."""
    import numpy as np
    from recir.dlrmv3 import Sample

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        u, c = int(rng.integers(1, max_uih + 1)), int(rng.integers(1, max_cand + 1))
        out.append(
            Sample(
                uih_ids=rng.integers(1, 50, u),
                uih_timestamps=1_600_000_000 + np.sort(rng.integers(0, 10**6, u)),
                uih_actions=rng.integers(0, 32, u),
                cand_ids=rng.integers(1, 50, c),
                cand_actions=rng.integers(0, 4, c),
                contextual=rng.integers(0, 50, 2),
            )
        )
    return out


def matches_one_eager_process(
    tmp_path: Path, flags: dict[str, Any], losses: list[float], checkpoint: Path, state_rtol: float
) -> None:
    """A launched run's logged `losses` and its final `checkpoint` (a `step-N` dir) equal one eager
    process's on the same `flags`: losses step by step, every parameter and optimizer-state slot."""
    from recir.dlrmv3 import load_checkpoint

    steps = int(flags["num_train_batches"])
    assert len(losses) == steps, losses
    eager_dir = tmp_path / "eager"
    ref = train(
        TrainOptions(target="eager", checkpoint_dir=str(eager_dir), checkpoint_every=steps, **flags),  # type: ignore[arg-type]
        log=lambda _: None,
    )
    # the log prints 6 decimals; compiled float32 kernels reorder sums
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=1e-4, atol=2e-6)
    state, _ = load_checkpoint(checkpoint)
    expect, _ = load_checkpoint(eager_dir / f"step-{steps}")
    compared = 0
    for key, want in expect.items():
        if key.startswith(("param:", "optim:")) and key in state and state[key].shape == want.shape:
            torch.testing.assert_close(state[key], want, rtol=state_rtol, atol=1e-5, msg=key)
            compared += 1
    assert compared > len([k for k in expect if k.startswith("param:")]), compared
