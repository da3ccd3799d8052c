"""DLRMv3 training speed: ms/step (min and median over rounds), samples/s, peak RSS and compile seconds
of eager PyTorch, the GPU path and the TPU path, in fp32 and bf16, at the configurations of
docs/dlrmv3-reference.md; ratios against the reference loop (its figures there, or, with `--reference
DIR`, the reference loop itself measured in the same run by benchmarks/reference_dlrmv3.py) and against
eager measured here. `prod GF`: the matrix products' (mm, addmm, bmm) GFLOP of the captured step that ran
each timed batch (mean); `GF/s`: those over the median step time, what the step would need from the CPU's
products alone (compare with a bare `torch.mm` of the same shapes: when it is close, the step is bound by
its products, and only fewer products make it faster). `prod ms`: those products timed in the same process
as bare calls (each distinct op, shape and dtype on fresh contiguous operands, this process's threads; ATen's
kernel and, for float32 `mm`/`addmm`, oneDNN's GEMM, the GPU path's own, whichever is faster; shared with
benchmarks/inference.py in benchmarks/_products.py), summed over the step: what the products alone cost at
the kernels' own speed, a floor the step approaches only as everything else vanishes.

Not a test. Each (configuration, target, precision) runs in its own process, so its peak RSS is its
own. The compiled paths pack each batch's real tokens (`--token_budget`, default auto: the per-batch mean
plus two standard deviations of real tokens, in `--token_buckets` budgets, default 4, each batch in the
smallest that holds it); eager and torch.compile rows run the padded layout, what a user's plain model
definition runs. Full-size compiles are slow on a small CPU (the GPU path's Inductor C++ compile takes minutes
cold); `--targets eager,tpu` or smaller `--embedding_dim/--num_layers` give quick numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from typing import Any

from _products import bare_ms, product_flops, product_nodes  # benchmarks/_products.py

# UIH length -> (batch, the reference loop's ms/step with 2 threads, like for like, from docs/dlrmv3-reference.md).
# The reference's max_seq_len counts the 2 contextual tokens and the 10 candidates: UIH 64 == its 76.
# 1024: not measured like for like yet; 3690 ms is its figure at max_seq_len 1024 (UIH about 1012), a
# slightly smaller workload, so the ratio printed against it errs against RecIR.
PEERS = {64: (16, 674.0), 256: (16, 2472.0), 1024: (4, 3690.0)}


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _one(args: argparse.Namespace) -> dict[str, float]:
    """One (configuration, target, precision) in this process: warm-up (compile), then timed rounds."""
    import resource

    import torch
    from recir.dlrmv3 import TrainOptions
    from recir.dlrmv3._model import loss_fn
    from recir.dlrmv3._train import build
    from recir.dlrmv3._trainers import make_trainer

    batch = args.batch_size or PEERS.get(args.uih, (16, math.nan))[0]
    device = _device(args.device)
    cuda = device == "cuda"
    opts = TrainOptions(
        target=args.target,
        batch_size=batch,
        uih_len=args.uih,
        num_candidates=args.num_candidates,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        hash_size=args.hash_size,
        input_dropout=args.input_dropout,
        layer_dropout=args.layer_dropout,
        num_threads=args.threads,
        precision=args.precision,
        table_dtype="fp32" if args.target in ("eager", "torch.compile") else args.table_dtype,
        matmul_precision=args.matmul_precision,
        host_memory=args.host_memory,
        token_budget=None
        if args.target in ("eager", "torch.compile") or args.token_budget == "off"
        else args.token_budget,
        token_buckets=args.token_buckets
        if args.target not in ("eager", "torch.compile") and args.token_budget == "auto"
        else 1,
        seed=0,
    )
    model, data, optimizers = build(opts)
    example = data.train_batch(0)
    started = time.perf_counter()
    # "torch.compile": the eager loop with torch.compile(loss_fn) (forward and, via AOTAutograd,
    # backward compiled; torch.optim's update eager), what a PyTorch user reaches for first.
    # "gpu+graphs": the GPU path replaying the whole step as one CUDA graph (CUDA only).
    # "gpu+autotune": the GPU path with Inductor's max-autotune (GEMM templates benchmarked against ATen's).
    # "gpu+regions" / "gpu+whole": the GPU path compiling each STU layer's code once
    # (GPUOptions(regions="repeated")) / the step as one graph; plain "gpu" is `train`'s default
    # (--compile_regions auto: repeated for the full-size model on the CPU device).
    variants = {
        "gpu+graphs": {"cuda_graphs": True},
        "gpu+autotune": {"mode": "max-autotune-no-cudagraphs"},
        "gpu+regions": {"regions": "repeated"},
        "gpu+whole": {"regions": "whole"},
    }
    # train's default with one CPU kernel choice put back to Inductor's own
    inductor_own = {
        "gpu+welford": {"cpu_variance": "welford"},
        "gpu+sleef": {"cpu_sigmoid": "sleef"},
        "gpu+atenbf16": {"cpu_bf16": "aten"},
    }
    gpu_like = (*variants, *inductor_own)
    target = "eager" if args.target == "torch.compile" else "gpu" if args.target in gpu_like else args.target
    options = None
    if args.target in variants:
        from recir.lower_gpu import GPUOptions

        options = GPUOptions(**variants[args.target])
    elif args.target == "gpu" or args.target in inductor_own:
        import dataclasses

        from recir.dlrmv3._train import gpu_options
        from recir.lower_gpu import GPUOptions

        options = gpu_options(opts)
        if args.target in inductor_own:
            options = dataclasses.replace(options or GPUOptions(), **inductor_own[args.target])
    trainer = make_trainer(
        target,
        model,
        optimizers,
        example,
        args.embedding_backend,
        precision=args.precision,
        device=device,
        compile_options=options,
        token_buckets=data.token_buckets,
        table_dtype=opts.table_dtype,
    )
    if args.target == "torch.compile":
        trainer.loss_fn = torch.compile(loss_fn)  # type: ignore[attr-defined]

    def batches(start: int, n: int) -> list:
        out = [data.train_batch(start + i) for i in range(n)]
        return [b.to(device) for b in out] if cuda else out  # host-to-device copies outside the timing

    for b in batches(0, args.warmup):
        trainer.step(b)
    for b in data.bucket_examples(0):  # --token_buckets: every budget's step compiled before timing
        trainer.step(b.to(device) if cuda else b)
    first = time.perf_counter() - started
    rounds = []
    flops: list[float] = []
    for r in range(args.rounds):
        todo = batches(args.warmup + r * args.steps, args.steps)
        flops += [_product_flops(trainer, b) for b in todo]
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for b in todo:
            loss, _ = trainer.step(b)
        float(loss)  # wait for asynchronous backends (and the CUDA stream)
        rounds.append((time.perf_counter() - started) / args.steps * 1000)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    floor = [
        _product_ms(trainer, b)
        for r in range(args.rounds)
        for b in batches(args.warmup + r * args.steps, args.steps)
    ]
    return {
        "device_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else math.nan,
        "min_ms": min(rounds),
        "median_ms": statistics.median(rounds),
        "samples_s": batch / (statistics.median(rounds) / 1000),
        "peak_rss_gib": peak_kib / 2**20,
        "compile_s": trainer.compile_seconds or first,
        # the TPU path's trace to StableHLO within it (the first budget's), nan elsewhere
        "trace_s": getattr(getattr(trainer, "compiled", None), "trace_seconds", math.nan),
        # every token budget's step (--token_buckets): the first's plus each later budget's first batch
        "compile_all_s": (trainer.compile_seconds or first) + sum(getattr(trainer, "compiles_seconds", [])),
        "torch": torch.__version__,
        "product_gflop": statistics.mean(flops) / 1e9,
        "product_ms": statistics.mean(floor),
    }


_PRODUCTS: dict[int, float] = {}


def _products(trainer: Any, batch: Any) -> tuple[Any, list[Any]]:
    """The captured step that runs ``batch`` (its token budget's, with --token_buckets) and its matrix
    products (``mm``, ``addmm``, ``bmm`` nodes, before lowering); (None, []) for eager."""
    bucketed = getattr(trainer, "by_rows", None)
    if bucketed is not None:
        from recir.dlrmv3._trainers import _rows

        trainer = bucketed.get(_rows(batch), trainer)
    step = getattr(trainer, "graph", None)
    if step is None:
        return None, []
    return step, product_nodes(step.graph)


def _per_step(memo: dict[int, float], trainer: Any, batch: Any, measure: Any) -> float:
    """``measure(products)`` of the captured step that runs ``batch``, once per step (``memo``); nan for eager."""
    step, nodes = _products(trainer, batch)
    if step is None:
        return math.nan
    if id(step) not in memo:
        memo[id(step)] = measure(nodes)
    return memo[id(step)]


_FLOORS: dict[int, float] = {}


def _product_flops(trainer: Any, batch: Any) -> float:
    """Floating-point operations of the matrix products of the captured step that runs ``batch``."""
    return _per_step(_PRODUCTS, trainer, batch, product_flops)


def _product_ms(trainer: Any, batch: Any) -> float:
    """What the matrix products of the step that runs ``batch`` cost as bare calls (``_products.bare_ms``),
    summed: its products alone at the kernels' own speed."""
    return _per_step(_FLOORS, trainer, batch, bare_ms)


def _reference_ms(args: argparse.Namespace, uih: int, batch: int) -> tuple[float, float, str]:
    """The reference loop's median ms/step and peak RSS (GiB) at ``uih`` and ``batch`` measured now
    (benchmarks/reference_dlrmv3.py on the checkout ``--reference`` names), and a note for the row when it
    could not be measured."""
    import pathlib

    here = pathlib.Path(__file__).parent
    root = pathlib.Path(args.reference)
    cmd = [sys.executable, str(here / "reference_dlrmv3.py"), "--gr_dir", str(root / "generative-recommenders"),
           "--deps_dir", str(root / "deps"), "--max_seq_len", str(uih + 2 + args.num_candidates),
           "--threads", str(args.threads), "--steps", str(args.rounds * args.steps + args.warmup),
           "--warmup", str(args.warmup), "--batch_size", str(batch)]  # fmt: skip
    if args.table_dtype == "fp16":  # the reference's own table dtype (its FBGEMM TBE has no bf16 tables)
        cmd += ["--emb_dtype", "fp16"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout or None)
    except subprocess.TimeoutExpired:
        return math.nan, math.nan, f"over --timeout {args.timeout} s"
    lines = [x for x in run.stdout.splitlines() if x.startswith("REF ")]
    if run.returncode != 0 or not lines:
        return math.nan, math.nan, " | ".join(run.stderr.strip().splitlines()[-3:])[-400:] or "no output"
    fields = dict(kv.split("=", 1) for kv in lines[-1].split()[1:])
    return float(fields["median_ms"]), float(fields.get("peak_rss_gib", "nan")), ""


def _child_args(args: argparse.Namespace, uih: int, target: str, precision: str) -> list[str]:
    keep = ("embedding_dim", "num_layers", "num_heads", "num_candidates", "hash_size", "threads", "steps",
            "rounds", "warmup", "input_dropout", "layer_dropout", "host_memory", "token_budget",
            "token_buckets", "table_dtype")  # fmt: skip
    out = [sys.executable, __file__, "--one", "--uih", str(uih), "--target", target, "--precision", precision]
    out += ["--device", args.device, "--batch_size", str(args.batch_size)]
    for k in keep:
        out += [f"--{k}", str(getattr(args, k))]
    if args.embedding_backend:
        out += ["--embedding_backend", args.embedding_backend]
    if args.matmul_precision:
        out += ["--matmul_precision", args.matmul_precision]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--targets",
        default="eager,gpu,tpu",
        help="comma-separated from eager, torch.compile, gpu, gpu+graphs (CUDA), gpu+autotune, gpu+regions, gpu+whole, "
        "gpu+welford (Inductor's Welford variances on the CPU), gpu+sleef (Inductor's SLEEF exp in the CPU sigmoid), "
        "gpu+atenbf16 (ATen's float32 -> bf16 rounding in the CPU kernels), tpu (default %(default)s)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="where eager and torch.compile run, and the GPU path compiles (auto: CUDA when present)",
    )
    p.add_argument("--batch_size", type=int, default=0, help="0: the reference figures' batch per UIH")
    p.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default %(default)s)")
    p.add_argument(
        "--configs",
        default="64,256,1024",
        help="UIH lengths of docs/dlrmv3-reference.md (default %(default)s)",
    )
    p.add_argument("--embedding_dim", type=int, default=512)
    p.add_argument("--num_layers", type=int, default=5)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--num_candidates", type=int, default=10)
    p.add_argument("--hash_size", type=int, default=100_000, help="rows per table (the peers cap at 100K)")
    p.add_argument(
        "--host_memory",
        choices=("retain", "release"),
        default="retain",
        help="every row, eager included: keep freed host memory between steps (recir-dlrmv3's default) or "
        "return it to the OS (the C library's default, what the reference loop's figures ran with)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (the peer figures: 2)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="steps per round (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps, compile included")
    p.add_argument("--input_dropout", type=float, default=0.2)
    p.add_argument("--layer_dropout", type=float, default=0.1)
    p.add_argument("--embedding_backend", default=None)
    p.add_argument(
        "--matmul_precision",
        choices=("highest", "high", "medium"),
        default=None,
        help="every row: recir-dlrmv3 train --matmul_precision (float32 products; on a TPU highest is about "
        "six bf16 passes, high three, medium one) (default: torch's, highest)",
    )
    p.add_argument(
        "--token_budget",
        default="auto",
        help="the GPU and TPU paths' token rows per batch (recir-dlrmv3 train --token_budget): a number, "
        "auto, or off (every padded slot) (default %(default)s)",
    )
    p.add_argument(
        "--token_buckets",
        type=int,
        default=4,
        help="with --token_budget auto: that many budgets, one compiled step each (recir-dlrmv3 train "
        "--token_buckets), every one compiled before timing; 'compile s' is the first budget's, 'all s' "
        "every budget's (default %(default)s)",
    )
    p.add_argument(
        "--table_dtype",
        choices=("fp32", "fp16", "bf16"),
        default="fp32",
        help="the GPU and TPU paths' embedding tables stored fp32, fp16 or bf16 (recir-dlrmv3 train "
        "--table_dtype); with --reference and fp16 the reference loop stores its tables fp16 too (its own "
        "default) (default %(default)s)",
    )
    p.add_argument(
        "--timeout", type=float, default=0, help="seconds per row (0: none); a row over it prints 'failed'"
    )
    p.add_argument(
        "--reference",
        default=None,
        metavar="DIR",
        help="measure the reference loop (Meta's generative-recommenders) in this run at each configuration, "
        "from DIR as benchmarks/reference_setup.sh makes it (DIR/generative-recommenders, DIR/deps), and print "
        "'vs ref' against that instead of the figures in docs/dlrmv3-reference.md (CPU only)",
    )
    # one measurement in this process (what the parent runs per row)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--uih", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--target", default="tpu", help=argparse.SUPPRESS)
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        import logging

        # the row's progress (capture, the lowering's trace and compile seconds) on stderr, which the parent
        # prints when the row fails or runs over --timeout
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
        logging.getLogger("jax").setLevel(logging.WARNING)  # its cache's per-entry lines
        print("RESULT " + json.dumps(_one(args)), flush=True)
        return

    import torch

    device = _device(args.device)
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "error: --device cuda, but torch.cuda.is_available() is False. Fix: run on a CUDA machine or --device cpu"
        )
    print(f"device {device}, {args.threads} CPU thread(s), torch {torch.__version__}, dim {args.embedding_dim}, "
          f"{args.num_layers} layers, {args.num_candidates} candidates, {args.hash_size} rows/table; ms/step over "
          f"{args.rounds} rounds of {args.steps} steps; tables {args.table_dtype} on the GPU/TPU paths; float32 products {args.matmul_precision or torch.get_float32_matmul_precision()}; host memory {args.host_memory}; GPU/TPU paths' token "
          f"budget {args.token_budget}, {args.token_buckets} bucket(s); 'vs ref' = reference loop ms / ours "
          + (f"(the reference loop measured now from {args.reference})" if args.reference else
             "(docs/dlrmv3-reference.md: 2 CPU threads, so CPU runs only)"))  # fmt: skip
    head = (
        f"{'uih':>5} {'batch':>5} {'target':>13} {'prec':>5} {'compile s':>9} {'all s':>6} {'min ms':>8} "
        f"{'median ms':>9}"
    )
    mem = "GPU GiB" if device == "cuda" else "RSS GiB"
    print(
        f"{head} {'samples/s':>9} {mem:>7} {'vs ref':>7} {'vs eager':>8} {'prod GF':>7} {'GF/s':>5} {'prod ms':>7}"
    )
    for uih in (int(x) for x in args.configs.split(",")):
        batch, peer = PEERS.get(uih, (16, math.nan))
        batch = args.batch_size or batch
        like_for_like = args.threads == 2 and device == "cpu" and batch == PEERS.get(uih, (0,))[0]
        peer = peer if like_for_like else math.nan
        if args.reference and device == "cpu":
            peer, peak, why = _reference_ms(args, uih, batch)
            row = f"{uih:>5} {batch:>5} {'reference':>13} {'fp32':>5}"
            samples = 1000 * batch / peer
            print(
                f"{row}  failed: {why}"
                if why
                else f"{row} {'':>9} {'':>6} {'':>8} {peer:>9.1f} {samples:>9.1f} {peak:>7.2f}",
                flush=True,
            )
        eager: dict[str, float] = {}
        for precision in args.precisions.split(","):
            for target in args.targets.split(","):
                row = f"{uih:>5} {batch:>5} {target:>13} {precision:>5}"
                try:
                    run = subprocess.run(
                        _child_args(args, uih, target, precision),
                        capture_output=True,
                        text=True,
                        timeout=args.timeout or None,
                    )
                except subprocess.TimeoutExpired as e:
                    print(f"{row}  failed: over --timeout {args.timeout} s", flush=True)
                    # where it got to: the row's log (capture, trace, XLA compile) on stderr
                    err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
                    print(
                        f"--- {' '.join(row.split())}: stderr so far\n{err[-20000:]}",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
                if run.returncode != 0 or not lines:
                    err = " | ".join(run.stderr.strip().splitlines()[-3:]) or "no output"
                    print(f"{row}  failed: {err[-400:]}", flush=True)
                    # the whole traceback on stderr: the table's line keeps only its end
                    print(
                        f"--- {' '.join(row.split())}: stderr\n{run.stderr[-20000:]}",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                r = json.loads(lines[-1][len("RESULT ") :])
                if target == "eager":
                    eager[precision] = r["median_ms"]
                base = eager.get(precision, eager.get("fp32", math.nan))
                used = r["device_peak_gib"] if device == "cuda" else r["peak_rss_gib"]
                gf = r.get("product_gflop", math.nan)
                print(
                    f"{row} {r['compile_s']:>9.1f} {r.get('compile_all_s', r['compile_s']):>6.1f} "
                    f"{r['min_ms']:>8.1f} {r['median_ms']:>9.1f} "
                    f"{r['samples_s']:>9.1f} {used:>7.2f} {peer / r['median_ms']:>6.2f}x {base / r['median_ms']:>7.2f}x "
                    f"{gf:>7.1f} {1000 * gf / r['median_ms']:>5.0f} {r.get('product_ms', math.nan):>7.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
