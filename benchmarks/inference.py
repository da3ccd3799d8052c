"""DLRMv3 serving speed: ms/batch and users/s of eager `model.eval()`, the GPU-path artifact (an
AOTInductor `.pt2`) and the TPU-path artifact (`jax.export`), scoring whole sequences and with the
cached-history swap (`recir-dlrmv3 export --serving cached-history`: the serving graph split by
`recir.transforms.cached_history`), at several batch sizes. `x eager`: against eager full-sequence scoring, timed
just before the row in each round (the median of the rounds' ratios, so the machine's drift between
minutes cancels). Eager cached history: the hand-written `HistoryEncoder` / `CandidateScorer`.

Not a test. Every user carries `--candidates` candidates (64). Cached-history rows are timed twice: a
user's first request (history encoded, then candidates scored) and a repeat request (the history cache
reused: candidates only). Each artifact's logits are checked against eager before it is timed. The
parameters are baked into every artifact (as constants). Model weights are the seeded initialisation:
speed does not depend on training. `x full`: a cached-history row against the same stack scoring the
full sequences. `prod ms`: the matrix products (mm, addmm, bmm) of the artifact's serving graph timed in the
same process as bare calls (each distinct op, shape and dtype, `--threads` threads; ATen's kernel and, for
float32 `mm`/`addmm`, oneDNN's GEMM, whichever is faster: benchmarks/_products.py), summed: what the products
alone cost at the kernels' own speed. `eager/prod`: eager full-sequence ms over it, the most `x
eager` the artifact could reach on this CPU if everything but its products took no time: a goal above it
needs fewer products or a faster CPU, not a better compiler (approximately: XLA:CPU has its own kernels, and
a product fused with its neighbours can beat the bare call by the memory traffic it saves).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _products import bare_ms, product_nodes  # benchmarks/_products.py


def _calls_per_round(fn: Callable[[], Any], min_seconds: float) -> int:
    fn()  # warm-up
    started = time.perf_counter()
    fn()
    return max(2, int(min_seconds / max(time.perf_counter() - started, 1e-6)))


def _mean_ms(fn: Callable[[], Any], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1000


def _timed(
    fn: Callable[[], Any], rounds: int, min_seconds: float, ref: tuple[Callable[[], Any], int] | None = None
) -> tuple[float, float]:
    """(median over `rounds` of the mean ms per call, each round at least `min_seconds` long; the median
    of the rounds' ratios ref ms / fn ms). With `ref` = (function, calls per round), each round times the
    function just before `fn`, so a ratio compares two stretches of the same minute: on a shared machine
    whose speed drifts by 10-20% between minutes, the ratio of two medians taken minutes apart drifts with
    it. Without, the ratio is 1."""
    n = _calls_per_round(fn, min_seconds)
    ms, ratios = [], []
    for _ in range(rounds):
        ref_ms = _mean_ms(*ref) if ref is not None else 0.0
        ms.append(_mean_ms(fn, n))
        ratios.append(ref_ms / ms[-1] if ref is not None else 1.0)
    return statistics.median(ms), statistics.median(ratios)


def _pin(threads: int) -> str:
    """Run this process (and the threads it starts) on `threads` of its cores, before JAX sizes its CPU
    thread pool from them: eager torch, the AOTInductor packages and the JAX artifacts then compute on
    the same cores. Returns them, e.g. "0" ("all" where affinity cannot be set)."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        return "all"
    allowed = sorted(os.sched_getaffinity(0))
    if threads >= len(allowed):
        return ",".join(map(str, allowed))
    os.sched_setaffinity(0, allowed[:threads])
    return ",".join(map(str, allowed[:threads]))


def _first_output(call: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *a: call(*a)[0]


def _time_cached(
    hist_fn: Callable[[], Any],
    cand_fn: Callable[[Any], Any],
    sync: Callable[[Any], Any],
    time_it: Callable[[Callable[[], Any]], tuple[float, float]],
    delta: Callable[[Any], float],
) -> tuple[tuple[float, float], tuple[float, float], float]:
    """((ms, x eager) of a first request: history then candidates, (ms, x eager) of a repeat: candidates
    against the kept cache, max |logit delta|) of one stack's two artifacts: `hist_fn()` -> the cache, `cand_fn(cache)`
    -> logits, on the request batch each closes over."""
    import jax

    with jax.enable_x64(True):
        cache = hist_fn()
        got = delta(cand_fn(cache))
        first = time_it(lambda: sync(cand_fn(hist_fn())))
        repeat = time_it(lambda: sync(cand_fn(cache)))
    return first, repeat, got


def _floor_ms(*graphs: Any) -> float:
    """What the matrix products of ``graphs`` (StepGraphs) cost as bare calls here, summed."""
    return sum(bare_ms(product_nodes(g.graph)) for g in graphs)


def _bench_batch(
    args: argparse.Namespace, B: int, work: Path
) -> list[tuple[str, tuple[float, float], float, float]]:
    """[(row name, (ms per batch, x eager), max |logit delta| against eager, prod ms)] at batch size B; x
    eager: the median of each round's ratio against eager full-sequence scoring timed just before it; prod
    ms: the artifact's graph's matrix products as bare calls (nan for eager)."""
    import jax
    import numpy as np
    import torch
    import torch.utils._pytree as pytree
    from jax import export as jax_export
    from recir.capture import capture_train_step
    from recir.dlrmv3 import TrainOptions
    from recir.dlrmv3._export import serving_pipeline
    from recir.dlrmv3._model import loss_fn
    from recir.dlrmv3._serving import CandidateScorer, HistoryEncoder, serving_max_len, split_batch
    from recir.dlrmv3._serving_export import cached_history_graphs, export_cached_history
    from recir.dlrmv3._train import build
    from recir.embedding import overrides
    from recir.lower_gpu import export as gpu_export
    from recir.lower_tpu import compile as tpu_compile
    from recir.transforms import to_inference

    opts = TrainOptions(
        target="eager",
        batch_size=B,
        uih_len=args.uih,
        num_candidates=args.candidates,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        hash_size=args.hash_size,
        num_threads=args.threads,
        seed=0,
    )
    model, data, optimizers = build(opts)
    batch = next(iter(data.eval_batches(1)))
    history, cand_ids = split_batch(model, batch, serving_max_len(model))
    batch.max_seq_len = history.max_seq_len  # the serving normaliser on every path
    real = torch.arange(args.candidates)[None, :] < batch.num_candidates[:, None]
    flat = pytree.tree_leaves(batch)
    rows: list[tuple[str, tuple[float, float], float, float]] = []
    nan = float("nan")

    def eager() -> Any:  # the reference every row is timed against, in the same rounds
        with torch.no_grad():
            return model(batch)

    def delta(got: Any) -> float:
        got = got if isinstance(got, torch.Tensor) else torch.from_numpy(np.array(got))  # jax.Array
        return float((got - expected)[real].abs().max())

    # Full sequences: the serving graph of the captured step, exported for each stack.
    model.train()  # capture traces the training step; to_inference drops dropout
    step = capture_train_step(model, optimizers, loss_fn, batch, overrides=overrides())
    served = to_inference(step)
    graphs = [("", served)]
    if args.bf16:  # the serving graph's products on bf16 copies (recir-dlrmv3 export --precision bf16)
        graphs.append((" bf16", serving_pipeline(None, "bf16").run(to_inference(step))))
    for q in args.quantize:  # tables stored quantised (export --quantize Q --quantize_kernel K)
        for kernel in ("aten", "fbgemm"):
            graphs.append((f" {q} {kernel}", serving_pipeline(q, "fp32", kernel).run(to_inference(step))))
    model.eval()
    with torch.no_grad():
        expected = model(batch)
        rows.append(("eager eval(), full sequence", _timed(eager, args.rounds, args.min_seconds), 0.0, nan))
    reference = (eager, _calls_per_round(eager, args.min_seconds))  # sized once for every row
    time_it = lambda fn: _timed(fn, args.rounds, args.min_seconds, ref=reference)  # noqa: E731
    for tag, graph in graphs:
        tensors = graph.init_state(model, optimizers)
        floor = _floor_ms(graph)
        stem = f"full.{B}{tag.replace(' ', '.')}"
        if "gpu" in args.paths:
            path = work / f"{stem}.pt2"
            gpu_export(graph, path, baked_state=tensors)
            package = torch._inductor.aoti_load_package(str(path))
            with torch.no_grad():
                ms = time_it(lambda: package(*flat))  # noqa: B023 (called before the next iteration)
                rows.append((f"GPU path .pt2{tag}, full sequence", ms, delta(package(*flat)[-1]), floor))
        if "tpu" in args.paths:
            path = work / f"{stem}.jax"
            manifest = tpu_compile(graph).export(path, baked_state=tensors)
            exp = jax_export.deserialize(bytearray(path.read_bytes()))
            with jax.enable_x64(bool(manifest["x64"])):
                jbatch = [
                    jax.numpy.asarray(np.asarray(t).astype(b["dtype"]))
                    for t, b in zip(flat, manifest["batch"])
                ]
                ms = time_it(lambda: jax.block_until_ready(exp.call(jbatch)))  # noqa: B023
                rows.append(
                    (f"TPU path jax.export{tag}, full sequence", ms, delta(exp.call(jbatch)[0]), floor)
                )

    # Cached history: eager modules, then the two artifacts of each stack.
    encode, score = HistoryEncoder(model), CandidateScorer(model)
    with torch.no_grad():
        cache = encode(*history.tensors())
        got = delta(score(*cache, cand_ids))
        rows.append(("eager, cached history: history + candidates",
                     time_it(lambda: score(*encode(*history.tensors()), cand_ids)), got, nan))  # fmt: skip
        rows.append(
            ("eager, cached history: candidates only", time_it(lambda: score(*cache, cand_ids)), got, nan)
        )
    floors: dict[str, tuple[float, float]] = {}  # precision -> (history + candidates products, candidates')
    for target, precision in [(t, p) for t in args.paths for p in ("fp32", "bf16")[: 1 + args.bf16]]:
        out = work / f"cached.{B}.{target}.{precision}"
        model.train()  # the graphs come from the captured training step (recir.transforms.cached_history)
        if precision not in floors:
            split = cached_history_graphs(model, optimizers, batch, precision=precision)
            floors[precision] = (_floor_ms(split.history, split.candidates), _floor_ms(split.candidates))
        manifest = export_cached_history(
            model, optimizers, batch, target, out, max_seq_len=serving_max_len(model), precision=precision
        )
        model.eval()
        files = [work / manifest["entries"][n]["file"] for n in ("history", "candidates")]
        name = {"gpu": "GPU path .pt2", "tpu": "TPU path jax.export"}[target] + (
            " bf16" if precision == "bf16" else ""
        )
        if target == "gpu":
            hist_pkg, cand_pkg = (torch._inductor.aoti_load_package(str(f)) for f in files)
            hist_fn: Callable[[], Any] = lambda: hist_pkg(*flat)  # noqa: B023, E731
            cand_fn: Callable[[Any], Any] = lambda cache: cand_pkg(*flat, *cache)[0]  # noqa: B023, E731
            sync: Callable[[Any], Any] = lambda x: x  # noqa: E731
        else:
            hist_exp, cand_exp = (jax_export.deserialize(bytearray(f.read_bytes())) for f in files)
            dtypes = [b["dtype"] for b in manifest["entries"]["history"]["inputs"]]
            with jax.enable_x64(True):  # int64 ids
                jflat = [jax.numpy.asarray(np.asarray(t).astype(d)) for t, d in zip(flat, dtypes)]
            hist_fn = lambda: hist_exp.call(jflat)  # noqa: B023, E731
            cand_fn = lambda cache: cand_exp.call([*jflat, *cache])[0]  # noqa: B023, E731
            sync = jax.block_until_ready
        first, repeat, got = _time_cached(hist_fn, cand_fn, sync, time_it, delta)
        rows.append((f"{name}, cached history: history + candidates", first, got, floors[precision][0]))
        rows.append((f"{name}, cached history: candidates only", repeat, got, floors[precision][1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--batch_sizes", default="1,16,256", help="users per batch, comma-separated (default %(default)s)"
    )
    p.add_argument("--paths", default="gpu,tpu", help="artifacts to time besides eager (default %(default)s)")
    p.add_argument("--candidates", type=int, default=64, help="candidates per user (default %(default)s)")
    p.add_argument("--uih", type=int, default=128, help="UIH length (default %(default)s)")
    p.add_argument("--embedding_dim", type=int, default=64)
    p.add_argument("--num_layers", type=int, default=2)
    p.add_argument("--num_heads", type=int, default=2)
    p.add_argument("--hash_size", type=int, default=10_000, help="rows per table")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU cores for every stack (default %(default)s): torch's threads, and the process pinned to "
        "that many cores, which also bounds XLA:CPU's thread pool (JAX takes every core it may run on)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="timed rounds, the median reported (default %(default)s)"
    )
    p.add_argument(
        "--min_seconds", type=float, default=0.5, help="length of one timed round (default %(default)s)"
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="also time the artifacts with bf16 matrix products (export --precision bf16), full sequence "
        "and cached history",
    )
    p.add_argument(
        "--quantize",
        default="",
        help="also time full-sequence artifacts with the tables stored quantised, comma-separated int8/fp16, "
        "each with both --quantize_kernel choices (aten; fbgemm: FBGEMM's inference TBE in the .pt2)",
    )
    p.add_argument("--workdir", default=None, help="where the artifacts go (default: a temporary directory)")
    args = p.parse_args()
    args.paths = [x for x in args.paths.split(",") if x]
    args.quantize = [x for x in args.quantize.split(",") if x]
    if any(q not in ("int8", "fp16") for q in args.quantize):
        p.error(f"--quantize takes int8 and/or fp16, got {args.quantize}")
    bad = [x for x in args.paths if x not in ("gpu", "tpu")]
    if bad:
        p.error(f"--paths takes gpu and/or tpu, got {bad}")
    sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    cores = _pin(args.threads)
    print(f"DLRMv3 serving: UIH {args.uih}, {args.candidates} candidates/user, dim {args.embedding_dim}, "
          f"{args.num_layers} layers, {args.num_heads} heads, {args.hash_size} rows/table, {args.threads} threads, cores {cores}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for B in sizes:
            rows = _bench_batch(args, B, work)
            full = {name.split(",")[0]: ms for name, (ms, _), _, _ in rows if name.endswith("full sequence")}
            eager_ms = full["eager eval()"]
            print(f"\nbatch {B} ({B * args.candidates} candidates)")
            print(
                f"{'path':<66} {'ms/batch':>9} {'users/s':>9} {'x eager':>8} {'x full':>7} {'max |dlogit|':>12}"
                f" {'prod ms':>8} {'eager/prod':>10}"
            )
            for name, (ms, x_eager), d, floor in rows:
                stack = "eager eval()" if name.startswith("eager") else name.split(",")[0]
                x_full = f"{full[stack] / ms:>7.2f}" if "cached" in name and stack in full else f"{'':>7}"
                bound = f"{floor:>8.2f} {eager_ms / floor:>10.2f}" if floor == floor else f"{'':>8} {'':>10}"
                print(
                    f"{name:<66} {ms:>9.2f} {B / (ms / 1000):>9.1f} {x_eager:>8.2f} {x_full} {d:>12.1e} {bound}"
                )


if __name__ == "__main__":
    main()
