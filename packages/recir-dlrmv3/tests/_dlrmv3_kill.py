"""Kill-test driver (test code only): imports `recir-dlrmv3 train` once, then forks one training run per
attempt and SIGKILLs it at the attempt's point; the last attempt runs to the end. Usage:

    python _dlrmv3_kill.py '{"argv": [...], "checkpoint_dir": DIR, "schedule": [[kind, n, delay], ...]}'

`kind` "step": kill `delay` seconds after the run logs its `n`-th step of this attempt (a random point in
the next step's compute or checkpoint write). `kind` "write": the run's `n`-th checkpoint write of this
attempt sleeps once its tensors are on disk and before `recir.json` and the rename; it is killed there.
Prints one JSON line per attempt: {"kind", "n", "killed", "signal", "exit", "tmp_dirs", "steps_logged",
"resumed_from" (the step it resumed from, None for a fresh start), "writing" (the .tmp-step-N it was in)}.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import recir.distributed._checkpoint as checkpoint_module
import torch.distributed.checkpoint  # noqa: F401  (imported once here, not in every child)
from recir.dlrmv3._cli import main
from recir.dlrmv3._train import train  # noqa: F401


def _child(argv: list[str], pause_at_write: int, out_fd: int) -> None:
    os.dup2(out_fd, 1)
    if pause_at_write:
        real = checkpoint_module._write_synced
        writes = [0]

        def slow(path: Path, text: str) -> None:
            writes[0] += 1
            if writes[0] == pause_at_write:
                print("KILLTEST writing", path.parent.name, flush=True)
                time.sleep(120)
            real(path, text)

        checkpoint_module._write_synced = slow  # type: ignore[assignment]
    code = 1
    try:
        code = main(argv)
    finally:
        sys.stdout.flush()
        os._exit(code)


def _attempt(argv: list[str], root: Path, kind: str | None, n: int, delay: float) -> dict:  # type: ignore[type-arg]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        _child(argv, n if kind == "write" else 0, w)
    os.close(w)
    steps = 0
    killed = False
    resumed_from = writing = None
    with os.fdopen(r) as lines:
        for line in lines:
            if " INFO epoch " in line:
                steps += 1
            if " INFO resumed from step " in line:
                resumed_from = int(line.split(" INFO resumed from step ")[1].split()[0])
            if line.startswith("KILLTEST writing"):
                writing = line.split()[-1]
            if (kind == "step" and " INFO epoch " in line and steps == n) or (
                kind == "write" and line.startswith("KILLTEST writing")
            ):
                time.sleep(delay)
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
    _, status = os.waitpid(pid, 0)
    tmp = sorted(p.name for p in root.glob(".tmp-*"))
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    return {"kind": kind, "n": n, "killed": killed, "signal": sig, "exit": code, "tmp_dirs": tmp,
            "steps_logged": steps, "resumed_from": resumed_from, "writing": writing}  # fmt: skip


def run(spec: dict) -> None:  # type: ignore[type-arg]
    root = Path(spec["checkpoint_dir"])
    for kind, n, delay in spec["schedule"]:
        print(json.dumps(_attempt(spec["argv"], root, kind, n, delay)), flush=True)
    print(json.dumps(_attempt(spec["argv"], root, None, 0, 0.0)), flush=True)  # to the end


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
