"""TensorBoard for `train --tensorboard_dir`: one sub-folder per run, the run's options as
hyper-parameters (HParams dashboard) and as text, and the scalars at the console's step numbers."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._optim import split_params
from ._options import TrainOptions


def open_writer(root: str, opts: TrainOptions) -> Any:
    """A SummaryWriter on a new ``<root>/<YYYYmmdd-HHMMSS>-<target>[-N]`` folder, with the options
    written as text (visible while the run goes on)."""
    from torch.utils.tensorboard import SummaryWriter

    base = Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{opts.target}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    writer = SummaryWriter(str(run_dir))
    rows = "\n".join(f"| {k} | {v} |" for k, v in hparams(opts).items())
    writer.add_text("config", "| option | value |\n|---|---|\n" + rows, 0)
    return writer


def hparams(opts: TrainOptions) -> dict[str, int | float | str | bool]:
    """Every option, as a value the HParams plugin takes (None -> "none", tuples joined by commas)."""
    out: dict[str, int | float | str | bool] = {}
    for key, value in dataclasses.asdict(opts).items():
        if value is None:
            value = "none"
        elif isinstance(value, (tuple, list)):
            value = ",".join(map(str, value))
        out[key] = value
    return out


def write_hparams(writer: Any, opts: TrainOptions, metrics: dict[str, float]) -> None:
    """The HParams dashboard's record of this run: its options against its final ``eval/*`` scalars."""
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    for summary in hparams_summaries(hparams(opts), {f"eval/{k}": v for k, v in metrics.items()}):
        writer.file_writer.add_summary(summary)


def learning_rates(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, float]:
    """``{"dense": lr, "tables": lr}`` from the optimizers' parameter groups (no schedule: constant)."""
    tables = {id(p) for _, p in split_params(model)[1]}
    rates: dict[str, float] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            kind = "tables" if any(id(p) in tables for p in group["params"]) else "dense"
            rates[kind] = float(group["lr"])
    return rates
