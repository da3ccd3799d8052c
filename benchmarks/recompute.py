"""Activation recomputation on DLRMv3: peak step memory and ms/step with `--recompute none|layers|auto`.

Not a test. Each (configuration, target, mode) runs in its own process with glibc's mmap threshold
pinned at 64 KiB (`MALLOC_MMAP_THRESHOLD_`) and freed memory returned to the OS (`host_memory
release`), so the growth of the resident set during a step (peak minus the resident set before it,
`/proc/self/clear_refs` resetting the peak) is the step's transient memory: activations and
workspaces, the model and optimizer state excluded. The TPU path also prints XLA's own figure (the
compiled program's temporary buffers, `memory_analysis()`), the graph rows the interpreter's model
(`recir.transforms.transient_peak_bytes`). Ratios are against `none` measured in the same run.

    uv run --locked python benchmarks/recompute.py --configs 1024:4,4096:1 --targets tpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _rss() -> tuple[int, int]:
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                fields[line.split(":")[0]] = int(line.split()[1]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _one(args: argparse.Namespace) -> dict[str, float]:
    from recir.dlrmv3 import TrainOptions
    from recir.dlrmv3._train import build
    from recir.dlrmv3._trainers import make_trainer
    from recir.transforms import transient_peak_bytes

    opts = TrainOptions(
        target=args.target,
        batch_size=args.batch,
        uih_len=args.uih,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        hash_size=args.hash_size,
        num_threads=args.threads,
        host_memory="release",
        recompute=args.mode,
        seed=0,
    )
    model, data, optimizers = build(opts)
    started = time.perf_counter()
    trainer = make_trainer(args.target, model, optimizers, data.train_batch(0), recompute=args.mode)
    trainer.step(data.train_batch(0))
    out: dict[str, float] = {"compile_s": time.perf_counter() - started}
    out["graph_peak_mib"] = transient_peak_bytes(trainer.graph) / 2**20
    if args.target == "tpu":
        analysis = trainer.compiled._compiled.memory_analysis()
        out["xla_temp_mib"] = analysis.temp_size_in_bytes / 2**20
    times, peaks = [], []
    for i in range(1, args.steps + 1):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the resident-set peak starts again from the current resident set
        before = _rss()[0]
        t = time.perf_counter()
        trainer.step(data.train_batch(i))
        times.append(time.perf_counter() - t)
        peaks.append(_rss()[1] - before)
    out["median_ms"] = 1000 * statistics.median(times)
    out["step_peak_mib"] = max(peaks) / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="1024:4,4096:1", help="UIH:batch pairs (default %(default)s)")
    p.add_argument("--targets", default="tpu,gpu", help="comma-separated (default %(default)s)")
    p.add_argument("--modes", default="none,layers,auto", help="--recompute values (default %(default)s)")
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps after the compile step (default %(default)s)"
    )
    p.add_argument("--embedding_dim", type=int, default=512)
    p.add_argument("--num_layers", type=int, default=5)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--hash_size", type=int, default=100_000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--uih", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--target", default="tpu", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="none", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(_one(args)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    shared = ["--embedding_dim", str(args.embedding_dim), "--num_layers", str(args.num_layers),
              "--num_heads", str(args.num_heads), "--hash_size", str(args.hash_size),
              "--threads", str(args.threads), "--steps", str(args.steps)]  # fmt: skip
    print(f"{'UIH':>5} {'batch':>5} {'target':>6} {'mode':>6} {'ms/step':>8} {'x none':>7} "
          f"{'step MiB':>9} {'/ none':>7} {'XLA MiB':>8} {'graph MiB':>9} {'compile s':>9}", flush=True)  # fmt: skip
    for config in args.configs.split(","):
        uih, batch = (int(v) for v in config.split(":"))
        for target in args.targets.split(","):
            base: dict[str, float] = {}
            for mode in args.modes.split(","):
                cmd = [sys.executable, __file__, "--one", "--uih", str(uih), "--batch", str(batch),
                       "--target", target, "--mode", mode, *shared]  # fmt: skip
                run = subprocess.run(cmd, capture_output=True, text=True, env=env)
                row = f"{uih:>5} {batch:>5} {target:>6} {mode:>6}"
                if run.returncode != 0:
                    print(f"{row} failed: {run.stderr.strip().splitlines()[-1:]}", flush=True)
                    continue
                r = json.loads(run.stdout.strip().splitlines()[-1])
                base = base or r
                print(
                    f"{row} {r['median_ms']:8.0f} {r['median_ms'] / base['median_ms']:7.2f} "
                    f"{r['step_peak_mib']:9.0f} {r['step_peak_mib'] / max(base['step_peak_mib'], 1e-9):7.2f} "
                    f"{r.get('xla_temp_mib', float('nan')):8.0f} {r['graph_peak_mib']:9.0f} {r['compile_s']:9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
