"""Where XLA's compile of the TPU path's DLRMv3 step goes: one `benchmarks/dlrmv3.py` row (TPU path) with JAX's
profiler on around XLA's compile only, then a table of the compile's traced events (XLA's HLO passes, a TPU's
per-fusion code emission, scheduling and register allocation, XLA:CPU's MLIR passes), summed by name over
every compiler thread: exclusive seconds (nested events subtracted) and inclusive ones.

Threads run in parallel, so the sums can exceed the compile's wall time; the first line gives that. JAX's
compilation cache starts empty (RecIR's cache folder goes inside --trace_dir: a hit would compile nothing).
The trace stays in --trace_dir for TensorBoard's profile plugin or Perfetto.

    python benchmarks/xla_compile.py --uih 64 --precision fp32 -- --token_buckets 1
    python benchmarks/xla_compile.py --top 60 -- --num_layers 2 --embedding_dim 64

Arguments after `--` go to `benchmarks/dlrmv3.py`'s row as they are (see its --help). Measured with it on a
TPU v5e (README, "On a TPU"): scheduling and register allocation of the product fusions take most of a
full-size step's compile, and float32 products at `highest` precision multiply them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def summarise(trace: Path, top: int) -> list[str]:
    """Exclusive and inclusive seconds per event name of a Perfetto trace (JSON), nested events per thread."""
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    inclusive: collections.Counter[str] = collections.Counter()
    exclusive: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    threads: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in spans:
        inclusive[e["name"]] += e["dur"]
        count[e["name"]] += 1
        threads[(e.get("pid"), e.get("tid"))].append(e)
    for thread in threads.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_spans: list[dict] = []
        for e in thread:
            while open_spans and open_spans[-1]["ts"] + open_spans[-1]["dur"] <= e["ts"]:
                open_spans.pop()
            exclusive[e["name"]] += e["dur"]
            if open_spans:
                exclusive[open_spans[-1]["name"]] -= e["dur"]
            open_spans.append(e)
    lines = [f"{len(spans)} events on {len(threads)} threads; seconds summed over threads", ""]
    lines.append(f"{'exclusive s':>12} {'inclusive s':>12} {'count':>6}  event")
    for name, us in exclusive.most_common(top):
        lines.append(f"{us / 1e6:12.2f} {inclusive[name] / 1e6:12.2f} {count[name]:6d}  {name[:120]}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--uih", type=int, default=64, help="history length of the row (default 64)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="the row's precision")
    p.add_argument("--top", type=int, default=40, help="event names to print, by exclusive seconds")
    p.add_argument(
        "--trace_dir", default=None, help="where the profiler writes (default: a new temporary folder)"
    )
    p.add_argument("row", nargs="*", help="after --: more benchmarks/dlrmv3.py options for the row")
    args = p.parse_args()
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="xla-compile-"))

    import jax
    import jax.stages

    compile_lowered = jax.stages.Lowered.compile

    def profiled_compile(self, *a, **k):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True)
        try:
            return compile_lowered(self, *a, **k)
        finally:
            jax.profiler.stop_trace()
            seconds = time.perf_counter() - started
            traces = sorted(trace_dir.glob("**/perfetto_trace.json.gz"), key=os.path.getmtime)
            print(
                f"XLA compile on {jax.default_backend()}: {seconds:.1f} s wall; trace in {trace_dir}",
                flush=True,
            )
            print(
                "\n".join(summarise(traces[-1], args.top)) if traces else "no Perfetto trace written",
                flush=True,
            )

    jax.stages.Lowered.compile = profiled_compile  # type: ignore[method-assign]
    # an empty JAX cache: a hit would compile nothing
    os.environ["RECIR_CACHE_DIR"] = str(trace_dir / "cache")
    sys.path.insert(0, str(Path(__file__).parent))
    import dlrmv3 as bench  # benchmarks/dlrmv3.py

    sys.argv = [
        "dlrmv3.py", "--one", "--target", "tpu", "--uih", str(args.uih), "--precision", args.precision,
        "--rounds", "1", "--steps", "1", "--warmup", "1", *args.row,
    ]  # fmt: skip
    bench.main()


if __name__ == "__main__":
    main()
