"""`recir-dlrmv3 parity`: the same model, seed and batches trained eagerly and through a compiled
target; per step it compares the loss, every parameter and every shared optimizer-state slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._options import TrainOptions
from ._train import build
from ._trainers import EagerTrainer, make_trainer


@dataclass
class ParityRow:
    step: int
    loss_eager: float
    loss_compiled: float
    max_param_diff: float
    max_optim_diff: float
    worst_param: str
    worst_optim: str

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_eager - self.loss_compiled)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> tuple[float, str, int]:
    worst, name, n = 0.0, "-", 0
    for key, va in a.items():
        if not key.startswith(prefix) or key not in b:
            continue
        vb = b[key]
        if va.shape != vb.shape:
            continue  # a differently laid-out slot (e.g. a per-parameter vs global step)
        d = float((va.double() - vb.double()).abs().max()) if va.numel() else 0.0
        n += 1
        if d >= worst:
            worst, name = d, key
    return worst, name, n


def run_parity(
    opts: TrainOptions, steps: int, log: Callable[[str], None] = print, atol: float = 1e-4
) -> tuple[list[ParityRow], bool]:
    """Trains `steps` steps both ways; returns the rows and whether every difference is <= atol."""
    model_e, data, opt_e = build(opts)
    model_c, _, opt_c = build(dataclasses.replace(opts))
    eager = EagerTrainer(model_e, opt_e)
    compiled = make_trainer(opts.target, model_c, opt_c, data.train_batch(0), opts.embedding_backend)
    rows: list[ParityRow] = []
    log(f"parity: eager vs {compiled.description}, {steps} steps, atol {atol:g}")
    log(
        f"{'step':>4}  {'loss eager':>12}  {'loss compiled':>13}  {'|dloss|':>9}  {'max|dparam|':>11}  {'max|doptim|':>11}"
    )
    compared = (0, 0)
    for step in range(steps):
        batch = data.train_batch(step)
        le, _ = eager.step(batch)
        lc, _ = compiled.step(batch)
        se, sc = eager.state_dict(), compiled.state_dict()
        dp, wp, n_p = _max_diff(se, sc, "param:")
        do, wo, n_o = _max_diff(se, sc, "optim:")
        compared = (n_p, n_o)
        row = ParityRow(step + 1, float(le), float(lc), dp, do, wp, wo)
        rows.append(row)
        log(
            f"{row.step:>4}  {row.loss_eager:>12.6f}  {row.loss_compiled:>13.6f}  {row.loss_diff:>9.2e}  "
            f"{dp:>11.2e}  {do:>11.2e}"
        )
    ok = all(max(r.loss_diff, r.max_param_diff, r.max_optim_diff) <= atol for r in rows)
    worst = max(rows, key=lambda r: max(r.loss_diff, r.max_param_diff, r.max_optim_diff))
    log(
        f"compared {compared[0]} parameters and {compared[1]} optimizer-state slots per step; "
        f"worst parameter {worst.worst_param}, worst optimizer slot {worst.worst_optim}"
    )
    log(f"parity {'OK' if ok else 'FAILED'} (atol {atol:g})")
    return rows, ok
