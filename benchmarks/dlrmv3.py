"""DLRMv3 training speed: ms/step and samples/s of eager PyTorch, the GPU path and the TPU path at
the peer configurations of shared/DLRMV3.md, as ratios against the reference loop measured there.

Not a test. Full-size compiles are slow on a small CPU (the GPU path's Inductor C++ compile takes
minutes); `--targets eager,tpu` or smaller `--embedding_dim/--num_layers` give quick numbers.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from recir.dlrmv3 import TrainOptions
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer
from recir.transforms import RecIRError

# (max UIH length, batch, reference s/step with 2 threads, with 1 thread) from DLRMV3.md
PEERS = {64: (16, 0.55, 0.92), 256: (16, 2.25, 3.80), 1024: (4, 3.69, 6.04)}


def _bench(target: str, uih_len: int, batch: int, args: argparse.Namespace) -> tuple[float, float, float]:
    opts = TrainOptions(
        target=target,
        batch_size=batch,
        uih_len=uih_len,
        num_candidates=args.num_candidates,
        embedding_dim=args.embedding_dim,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        hash_size=args.hash_size,
        input_dropout=args.input_dropout,
        layer_dropout=args.layer_dropout,
        num_threads=args.threads,
        seed=0,
    )
    model, data, optimizers = build(opts)
    trainer = make_trainer(
        target, model, optimizers, data.train_batch(0), args.embedding_backend, precision=args.precision
    )
    started = time.perf_counter()
    for step in range(args.warmup):
        trainer.step(data.train_batch(step))
    first = time.perf_counter() - started
    batches = [data.train_batch(args.warmup + i) for i in range(args.steps)]
    started = time.perf_counter()
    for b in batches:
        loss, _ = trainer.step(b)
    float(loss)  # wait for asynchronous backends
    per_step = (time.perf_counter() - started) / args.steps
    return per_step * 1000, batch / per_step, max(trainer.compile_seconds, 0.0) or first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", default="eager,gpu,tpu", help="comma-separated (default %(default)s)")
    p.add_argument(
        "--configs", default="64,256,1024", help="max UIH lengths of DLRMV3.md (default %(default)s)"
    )
    p.add_argument("--embedding_dim", type=int, default=512)
    p.add_argument("--num_layers", type=int, default=5)
    p.add_argument("--num_heads", type=int, default=4)
    p.add_argument("--num_candidates", type=int, default=10)
    p.add_argument("--hash_size", type=int, default=100_000, help="rows per table (the peers cap at 100K)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (peer numbers: 2 and 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps, compile included")
    p.add_argument("--input_dropout", type=float, default=0.2)
    p.add_argument("--layer_dropout", type=float, default=0.1)
    p.add_argument("--embedding_backend", default=None)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="default %(default)s")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {args.threads} thread(s), dim {args.embedding_dim}, "
          f"{args.num_layers} layers, {args.num_candidates} candidates, {args.hash_size} rows/table")  # fmt: skip
    print(
        f"{'uih':>5} {'batch':>5} {'target':>6} {'compile s':>9} {'ms/step':>9} {'samples/s':>10} {'vs peer':>8}"
    )
    for uih in (int(x) for x in args.configs.split(",")):
        batch, peer2, peer1 = PEERS.get(uih, (16, math.nan, math.nan))
        peer = peer2 if args.threads >= 2 else peer1
        for target in args.targets.split(","):
            try:
                ms, sps, comp = _bench(target, uih, batch, args)
            except (RecIRError, ImportError, RuntimeError) as e:
                print(f"{uih:>5} {batch:>5} {target:>6}  failed: {str(e).splitlines()[0][:90]}")
                continue
            ratio = peer * 1000 / ms if math.isfinite(peer) else math.nan
            print(
                f"{uih:>5} {batch:>5} {target:>6} {comp:>9.1f} {ms:>9.1f} {sps:>10.1f} {ratio:>7.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
