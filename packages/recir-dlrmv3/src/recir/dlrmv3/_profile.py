"""`train --profile DIR`: a few steps after the compile step under the target's profiler, then a table of
where a step's time goes.

TPU path: a JAX profiler trace in DIR and the time per StepGraph region (module scope x phase, from
`recir.scope` on the nodes; recir.lower_tpu.node_seconds maps the trace's XLA kernels to nodes). Other
targets: a torch profiler trace (`DIR/trace.json`, Chrome format) and the time per operator/kernel;
the GPU path compiled in pieces (`--compile_regions repeated`, `auto`'s choice at full size) also the
time per piece's region (a repeated module instance in one phase, or the glue between them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("recir.dlrmv3")


class StepProfiler:
    """Profiles steps `first .. first + steps - 1` (call `before`/`after` around every step)."""

    def __init__(
        self, directory: str, target: str, trainer: Any, first: int, steps: int, emit: Callable[[str], None]
    ) -> None:
        self.dir, self.target, self.trainer = Path(directory), target, trainer
        self.first, self.last, self.emit = first, first + steps - 1, emit
        self.done = 0
        self._torch: Any = None
        self._jax = False

    def before(self, step: int) -> None:
        if step != self.first:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.target == "tpu":
            import jax

            jax.profiler.start_trace(str(self.dir))
            self._jax = True
        else:
            import torch
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():  # the GPU path on CUDA (and eager there): kernel times too
                activities.append(ProfilerActivity.CUDA)
            self._torch = profile(activities=activities)
            self._torch.__enter__()

    def after(self, step: int) -> None:
        if self._jax or self._torch is not None:
            self.done += 1
            if step >= self.last:
                self.close()

    def close(self) -> None:
        """Stops the profiler (if running) and emits the table; called at the end of training too."""
        if self._jax:
            import jax
            from recir.lower_tpu import node_seconds
            from recir.transforms import format_region_table, region_times

            jax.profiler.stop_trace()
            self._jax = False
            compiled = self.trainer.compiled  # its step: the graph as lowered (a plan's rewrites included)
            seconds = node_seconds(compiled, self.dir)
            table = format_region_table(region_times(compiled.step, seconds), steps=self.done)
            self._report(f"JAX profiler trace in {self.dir}", table)
        elif self._torch is not None:
            prof, self._torch = self._torch, None
            import torch

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(self.dir / "trace.json"))
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            averages = prof.key_averages()
            table = averages.table(sort_by=sort, row_limit=25)
            self._report(f"torch profiler trace in {self.dir / 'trace.json'}", table)
            per_piece = getattr(getattr(self.trainer, "compiled", None), "region_times", None)
            rows = per_piece(averages) if callable(per_piece) else None
            if rows:  # the GPU path compiled in pieces (--compile_regions repeated): time per region too
                from recir.transforms import format_region_table

                self.emit(
                    f"time per region (the GPU path's compiled pieces; host time), {self.done} step(s):"
                )
                for line in format_region_table(rows, steps=self.done).splitlines():
                    self.emit(line)

    def _report(self, where: str, table: str) -> None:
        self.emit(
            f"profile of {self.done} step(s) (steps {self.first + 1}-{self.first + self.done}): {where}"
        )
        for line in table.splitlines():
            self.emit(line)
