"""`recir-dlrmv3 parity`: the same model, seed and batches trained eagerly and through a compiled
target; per step it compares the loss and every parameter, buffer and optimizer-state slot of both sides
(a slot only one side has, another shape, or a NaN/Inf fails the run).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from recir.capture import shared_step_layout
from recir.transforms import ConfigError, lr_slot

from ._logs import log_info
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
    problems: list[str] = field(default_factory=list)  # slots that could not be compared, NaN/Inf

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_eager - self.loss_compiled)

    def ok(self, atol: float) -> bool:
        worst = max(self.loss_diff, self.max_param_diff, self.max_optim_diff)
        return not self.problems and math.isfinite(worst) and worst <= atol


@dataclass
class StateDiff:
    """The comparison of two states slot by slot: the largest |difference| of parameters and buffers and of
    optimizer state (with the slot it occurs in), how many slots and elements were compared, and every
    problem (a slot one side lacks, another shape, a NaN or Inf)."""

    max_param: float = 0.0
    worst_param: str = "-"
    max_optim: float = 0.0
    worst_optim: str = "-"
    slots: int = 0
    elements: int = 0
    problems: list[str] = field(default_factory=list)


COMPARED_KINDS = ("param:", "buffer:", "optim:")  # rng:* differ by design (separate generators)


def eager_layout(
    state: Mapping[str, torch.Tensor], optimizers: list[torch.optim.Optimizer]
) -> dict[str, torch.Tensor]:
    """An eager trainer's state in the captured step's layout: the per-parameter step counts as the shared
    `optim:step` (when equal), plus each param group's learning rate as `optim:group<i>:lr` (the captured
    step keeps it as state; eager keeps it in `param_groups`)."""
    out = shared_step_layout(state, lambda a, b: bool(torch.equal(a, b)))
    groups = [g for opt in optimizers for g in opt.param_groups]
    for i, group in enumerate(groups):
        out[lr_slot(i)] = torch.tensor(float(group["lr"]))
    return out


def compare_states(eager: Mapping[str, torch.Tensor], compiled: Mapping[str, torch.Tensor]) -> StateDiff:
    """Every `param:`/`buffer:`/`optim:` slot of either side against the other's (values as float64)."""
    diff = StateDiff()
    names = sorted(k for k in set(eager) | set(compiled) if k.startswith(COMPARED_KINDS))
    for name in names:
        if name not in compiled or name not in eager:
            side = "compiled" if name not in compiled else "eager"
            diff.problems.append(f"{name}: missing on the {side} side")
            continue
        a, b = torch.as_tensor(eager[name]), torch.as_tensor(compiled[name])
        if tuple(a.shape) != tuple(b.shape):
            diff.problems.append(f"{name}: shape {list(a.shape)} eager, {list(b.shape)} compiled")
            continue
        a, b = a.detach().cpu().double(), b.detach().cpu().double()
        for side, t in (("eager", a), ("compiled", b)):
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                diff.problems.append(f"{name}: {bad} NaN/Inf value(s) on the {side} side")
        d = float((a - b).abs().max()) if a.numel() else 0.0
        diff.slots, diff.elements = diff.slots + 1, diff.elements + a.numel()
        if name.startswith("optim:"):
            if not d <= diff.max_optim:  # `not <=`: a NaN difference becomes the worst
                diff.max_optim, diff.worst_optim = d, name
        elif not d <= diff.max_param:
            diff.max_param, diff.worst_param = d, name
    return diff


def run_parity(
    opts: TrainOptions, steps: int, log: Callable[[str], None] = log_info, atol: float = 1e-4
) -> tuple[list[ParityRow], bool]:
    """Trains `steps` steps both ways; returns the rows and whether every difference is <= atol."""
    changed = [
        f"--{k} {getattr(opts, k)}" for k in ("precision", "table_dtype") if getattr(opts, k) != "fp32"
    ]
    if changed:  # both sides would otherwise run fp32, the flags silently unused
        raise ConfigError(
            f"parity compares the captured step with eager fp32 training within --atol; {', '.join(changed)} "
            "change the step's maths, so no parity is claimed for them. Fix: run parity without them, and "
            "`train` with them (its eval metrics say what they cost)."
        )
    model_e, data, opt_e = build(opts, log)
    model_c, _, opt_c = build(opts, log, data=data)  # the same batches, a second model and optimizers
    eager = EagerTrainer(model_e, opt_e)
    from ._train import gpu_options, resolve_compile_regions

    compiled = make_trainer(
        opts.target,
        model_c,
        opt_c,
        data.train_batch(0),
        opts.embedding_backend,
        compile_options=gpu_options(opts),
        recompute=opts.recompute,
        token_buckets=data.token_buckets,
        mask_padding=opts.mask_padding,
    )
    rows: list[ParityRow] = []
    regions = f", --compile_regions {resolve_compile_regions(opts)}" if opts.target == "gpu" else ""
    log(f"parity: eager vs {compiled.description}{regions}, {steps} steps, atol {atol:g}")
    log(
        f"{'step':>4}  {'loss eager':>12}  {'loss compiled':>13}  {'|dloss|':>9}  {'max|dparam|':>11}  {'max|doptim|':>11}"
    )
    diff = StateDiff()
    for step in range(steps):
        batch = data.train_batch(step)
        le, _ = eager.step(batch)
        lc, _ = compiled.step(batch)
        theirs = compiled.state_dict()
        if isinstance(compiled, EagerTrainer):  # --target eager: both sides in the same layout
            theirs = eager_layout(theirs, opt_c)
        diff = compare_states(eager_layout(eager.state_dict(), opt_e), theirs)
        row = ParityRow(step + 1, float(le), float(lc), diff.max_param, diff.max_optim, diff.worst_param,
                        diff.worst_optim, list(diff.problems))  # fmt: skip
        for side, loss in (("eager", row.loss_eager), ("compiled", row.loss_compiled)):
            if not math.isfinite(loss):
                row.problems.append(f"loss: {loss} on the {side} side")
        rows.append(row)
        log(
            f"{row.step:>4}  {row.loss_eager:>12.6f}  {row.loss_compiled:>13.6f}  {row.loss_diff:>9.2e}  "
            f"{row.max_param_diff:>11.2e}  {row.max_optim_diff:>11.2e}"
        )
        for problem in row.problems:
            log(f"      problem: {problem}")
    ok = all(r.ok(atol) for r in rows)
    worst = max(rows, key=lambda r: max(r.loss_diff, r.max_param_diff, r.max_optim_diff))
    log(
        f"compared {diff.slots} slots and {diff.elements} elements per step (parameters, buffers, optimizer "
        f"state; {sum(len(r.problems) for r in rows)} problem(s)); worst parameter {worst.worst_param}, "
        f"worst optimizer slot {worst.worst_optim}"
    )
    log(f"parity {'OK' if ok else 'FAILED'} (atol {atol:g})")
    return rows, ok
