"""Embedding step time versus table size: a 10,000-row and a 5,000,000-row table at the same batch.

RecIR's sparse row-wise updates should make the step cost grow with the ids in a batch, not the table:
the printed ratio (large / small step time) should be ~1.0 (goal <= 1.2) on each lowering path, next to
the dense-gradient baseline (``nn.EmbeddingBag`` + ``torch.optim``), whose step grows with the table.
``lower_gpu`` keeps the lookups and the row update in the Inductor-compiled step (``in_graph``);
``lower_gpu_tbe`` trains the table with FBGEMM's split TBE and its fused backward + optimizer outside it
(``embedding_backend="fbgemm"``; FBGEMM's CPU build here).
Each (path, size) runs in its own process so peak-memory numbers are not mixed.

``--ring`` instead compares, on 8 JAX host devices (``JAX_PLATFORMS=cpu``, not a TPU), a row-sharded
table's lookups through the ring shift (recir-lower-tpu's Pallas kernels, interpret mode) against
GSPMD's own partitioned gather: the bare lookup (forward + backward) and the compiled training step.

    uv run python benchmarks/embedding.py [--paths interpreter,lower_gpu,lower_tpu,baseline] [--steps 20]
    uv run python benchmarks/embedding.py --ring [--ring-rows 100000] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

PATHS = ("interpreter", "lower_gpu", "lower_gpu_tbe", "lower_tpu", "baseline")


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _batches(rows: int, args: argparse.Namespace, n: int) -> list[tuple[Any, Any]]:
    """``n`` (JaggedBatch batch, (values, offsets)) pairs with the same ids, padded to one bucket."""
    import torch
    from recir.embedding import pad_to_bucket
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(0)
    out = []
    cap = args.batch * args.ids_per_sample * 2
    for _ in range(n):
        lengths = torch.randint(0, 2 * args.ids_per_sample, (args.batch,), generator=gen)
        hi = min(rows, args.small) if args.same_ids else rows
        values = torch.randint(0, hi, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths)
        jb, _ = pad_to_bucket(kjt, [cap])
        y = torch.randn(args.batch, generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
        out.append(({"features": jb, "y": y}, (values, offsets, y)))
    return out


def _loss_fn(model: Any, batch: dict[str, Any]) -> Any:
    pooled = model(batch["features"]).values()
    return (pooled.sum(1) - batch["y"]).pow(2).mean()


def worker(path: str, rows: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rss0 = _rss_kb("VmRSS")
    batches = _batches(rows, args, args.steps + args.warmup)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    compile_s = 0.0
    if path == "baseline":
        bag = nn.EmbeddingBag(rows, args.dim, mode="sum")
        opt = torch.optim.SGD(bag.parameters(), lr=args.lr)

        def run(i: int) -> None:
            values, offsets, y = batches[i][1]
            opt.zero_grad()
            (bag(values, offsets).sum(1) - y).pow(2).mean().backward()
            opt.step()

    else:
        from recir.capture import capture_train_step
        from recir.embedding import HUGE_PAGES_MIN_BYTES, overrides, prepare_for_lowering
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        model = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t", embedding_dim=args.dim, num_embeddings=rows, feature_names=["f"])
            ]
        )
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        step = capture_train_step(model, opt, _loss_fn, batches[0][0], overrides=overrides())
        huge_pages = None if args.huge_pages == "off" else HUGE_PAGES_MIN_BYTES
        if path == "interpreter":
            runner: Any = prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu")
        elif path in ("lower_gpu", "lower_gpu_tbe"):
            import recir.lower_gpu

            # lower_gpu: the in-graph row update (and ATen lookups) in the Inductor step; lower_gpu_tbe:
            # FBGEMM's split TBE with its fused backward + SGD outside it
            backend = "fbgemm" if path == "lower_gpu_tbe" else "in_graph"
            gpu = recir.lower_gpu.GPUOptions(huge_pages_min_bytes=huge_pages)
            runner = recir.lower_gpu.compile(step, device=device, embedding_backend=backend, options=gpu)
        else:
            import recir.lower_tpu

            tpu = recir.lower_tpu.TPUOptions(huge_pages_min_bytes=huge_pages)
            runner = recir.lower_tpu.compile(prepare_for_lowering(step, target="tpu"), options=tpu)
        holder = {"state": runner.init_state(model, opt)}
        del model, opt

        def run(i: int) -> None:
            holder["state"], _ = runner(holder["state"], batches[i][0])

        t0 = time.perf_counter()
        run(0)
        compile_s = time.perf_counter() - t0
    rss_setup = _rss_kb("VmRSS")
    for i in range(args.warmup):
        run(i)
    if device == "cuda":
        torch.cuda.synchronize()
    _reset_peak()
    rss_before = _rss_kb("VmRSS")
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        t0 = time.perf_counter()
        run(i)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return {
        "path": path,
        "rows": rows,
        "step_ms": 1000 * times[len(times) // 2],
        "compile_s": compile_s,
        "setup_mb": (rss_setup - rss0) / 1024,
        "step_peak_mb": (_rss_kb("VmHWM") - rss_before) / 1024,
        "table_mb": rows * args.dim * 4 / 2**20,
    }


RING_DEVICES = 8


def _median_ms(run: Any, steps: int, warmup: int) -> float:
    for i in range(warmup):
        run(i)
    times = []
    for i in range(warmup, warmup + steps):
        t0 = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def ring_worker(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    """``backend`` (in_graph: GSPMD's gather, or ring_shift) on a table row-sharded over 8 host devices."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import recir.distributed as rd
    import recir.lower_tpu
    import torch
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from recir.capture import capture_train_step
    from recir.embedding import overrides
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if jax.device_count() < RING_DEVICES:
        raise SystemExit(f"needs {RING_DEVICES} JAX devices, found {jax.device_count()}")
    torch.manual_seed(0)
    rows, dim = args.ring_rows, args.dim
    # the bare lookup, forward + backward: table[ids] and the table's gradient, both sharded over "x"
    mesh = Mesh(np.array(jax.devices()[:RING_DEVICES]), ("x",))
    table = jax.device_put(jnp.ones((rows, dim), jnp.float32), NamedSharding(mesh, P("x", None)))
    n_ids = args.batch * args.ids_per_sample
    ids = [
        jax.device_put(
            jnp.asarray(np.random.default_rng(k).integers(0, rows, n_ids)), NamedSharding(mesh, P("x"))
        )
        for k in range(args.steps + args.warmup)
    ]
    if backend == "ring_shift":
        lookup = lambda t, i: recir.lower_tpu.ring_shift_lookup(t, i, mesh, "x")  # noqa: E731
    else:
        lookup = lambda t, i: jnp.take(t, i, axis=0)  # noqa: E731
    fwd_bwd = jax.jit(jax.value_and_grad(lambda t, i: (lookup(t, i) ** 2).sum()))
    lookup_ms = _median_ms(lambda k: jax.block_until_ready(fwd_bwd(table, ids[k])), args.steps, args.warmup)
    # the training step: an EmbeddingBagCollection table, SGD, planned row-wise over the 8 devices
    batches = _batches(rows, args, args.steps + args.warmup)
    model = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"])]
    )
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    step = capture_train_step(model, opt, _loss_fn, batches[0][0], overrides=overrides())
    plan = rd.plan(step, rd.row_wise(), rd.Mesh(axes={"data": RING_DEVICES}), batch="global")
    compiled = recir.lower_tpu.compile(step, plan, mesh=plan.mesh, embedding_backend=backend)
    holder = {"state": compiled.init_state(model, opt)}

    def train(k: int) -> None:
        holder["state"], out = compiled(holder["state"], batches[k][0])

    t0 = time.perf_counter()
    train(0)
    compile_s = time.perf_counter() - t0
    step_ms = _median_ms(train, args.steps, args.warmup)
    return {"backend": backend, "lookup_ms": lookup_ms, "step_ms": step_ms, "compile_s": compile_s}


def ring_main(args: argparse.Namespace, passthrough: list[str]) -> None:
    print(
        f"row-sharded table of {args.ring_rows:,} rows x {args.dim} over {RING_DEVICES} JAX host devices "
        f"(JAX's CPU backend, not a TPU), batch {args.batch}, ~{args.ids_per_sample} ids/sample; "
        f"median of {args.steps} steps"
    )
    header = f"{'lookup':<22} {'lookup fwd+bwd ms':>18} {'train step ms':>14} {'compile s':>10}"
    print(header)
    print("-" * len(header))
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={RING_DEVICES}",
    }
    names = {"in_graph": "GSPMD gather (in_graph)", "ring_shift": "ring shift (Pallas)"}
    for backend in ("in_graph", "ring_shift"):
        cmd = [sys.executable, __file__, "--ring-worker", backend, *passthrough]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{names[backend]:<22} unavailable: {err[:120]}")
            continue
        r = json.loads(line[0][7:])
        print(f"{names[backend]:<22} {r['lookup_ms']:18.2f} {r['step_ms']:14.2f} {r['compile_s']:10.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--small", type=int, default=10_000)
    p.add_argument("--large", type=int, default=5_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ids-per-sample", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--same-ids",
        action="store_true",
        help="draw ids from the small table's range for both sizes (separates table size from cache misses)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    p.add_argument(
        "--huge-pages",
        choices=("on", "off"),
        default="on",
        help="lower_gpu / lower_tpu: back tables of 256 MiB and more by transparent huge pages (the "
        "lowerings' default, huge_pages_min_bytes) or not (off), for an A/B of the TLB's share",
    )
    p.add_argument("--ring", action="store_true", help="ring shift vs GSPMD gather on 8 JAX host devices")
    p.add_argument("--ring-rows", type=int, default=100_000, help="--ring: table rows (divisible by 8)")
    p.add_argument("--worker", nargs=2, metavar=("PATH", "ROWS"), help=argparse.SUPPRESS)
    p.add_argument("--ring-worker", metavar="BACKEND", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker[0], int(args.worker[1]), args)))
        return
    if args.ring_worker:
        print("RESULT " + json.dumps(ring_worker(args.ring_worker, args)))
        return
    passthrough = [
        f"--{k.replace('_', '-')}" + ("" if isinstance(v, bool) else f"={v}")
        for k, v in vars(args).items()
        if k not in ("paths", "worker", "ring", "ring_worker") and v is not False and v is not None
    ]
    if args.ring:
        ring_main(args, passthrough)
        return
    print(
        f"embedding step time: tables of {args.small:,} and {args.large:,} rows x {args.dim}, batch {args.batch}, "
        f"~{args.ids_per_sample} ids/sample (SGD), median of {args.steps} steps"
        + (f", ids in [0, {args.small:,}) for both" if args.same_ids else ", ids uniform over each table")
    )
    header = f"{'path':<12} {'small ms':>9} {'large ms':>9} {'ratio':>6} {'step peak MB (small/large)':>27} {'setup MB (large)':>17}"
    print(header)
    print("-" * len(header))
    env = {**os.environ, "RECIR_EMBEDDING_CHECKS": os.environ.get("RECIR_EMBEDDING_CHECKS", "1")}
    for path in args.paths.split(","):
        res = []
        for rows in (args.small, args.large):
            cmd = [sys.executable, __file__, "--worker", path, str(rows), *passthrough]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not line:
                err = (proc.stderr.strip().splitlines() or ["?"])[-1]
                print(f"{path:<12} unavailable: {err[:120]}")
                break
            res.append(json.loads(line[0][7:]))
        if len(res) == 2:
            s, big = res
            print(
                f"{path:<12} {s['step_ms']:9.2f} {big['step_ms']:9.2f} {big['step_ms'] / s['step_ms']:6.2f} "
                f"{s['step_peak_mb']:13.1f} / {big['step_peak_mb']:<11.1f} {big['setup_mb']:12.0f}"
                f"   (table {big['table_mb']:.0f} MB)"
            )


if __name__ == "__main__":
    main()
