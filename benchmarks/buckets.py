"""Bucket feedback: padding waste before and after `recir.embedding.suggest_buckets`, no timing.

For each length distribution it prints the padding waste (padded slots per real id) and the number of
buckets (compiles) of: one static capacity (DLRMv3's batch x `--uih_len`, what it pads to today; the largest size seen for
the synthetic ones), powers of
two from 8 (`pad_to_bucket`'s default), and the suggested buckets for a budget of 2, 4 and 8 compiles.

- `dlrmv3-debug`: the real UIH tokens per batch of DLRMv3's default `debug` dataset (batch 32,
  `--uih_len 64`: the static capacity is 32 x 64 slots), as a jagged UIH feature would be bucketed.
- `lognormal`, `zipf`: skewed synthetic ids-per-batch distributions (seeded).

    uv run python benchmarks/buckets.py [--batches 400]
"""

from __future__ import annotations

import argparse
import random

from recir.embedding import bucketize, padding_waste, suggest_buckets


def dlrmv3_debug(batches: int) -> tuple[list[int], int]:
    from recir.dlrmv3 import TrainOptions
    from recir.dlrmv3._train import build

    opts = TrainOptions(batch_size=32, uih_len=64)
    _, data, _ = build(opts)
    sizes = [int(data.train_batch(i).uih_lengths.sum()) for i in range(batches)]
    return sizes, opts.batch_size * opts.uih_len


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=400, help="batches (samples of the distribution) per row")
    args = p.parse_args()
    rng = random.Random(0)
    debug, capacity = dlrmv3_debug(args.batches)
    dists = {
        "dlrmv3-debug": (debug, capacity),
        "lognormal": [min(int(rng.lognormvariate(5.0, 0.7)), 8192) for _ in range(args.batches)],
        "zipf": [min(int(8 * rng.paretovariate(1.2)), 8192) for _ in range(args.batches)],
    }
    dists = {k: v if isinstance(v, tuple) else (v, max(v)) for k, v in dists.items()}  # static: the largest
    print(f"{'distribution':>13} {'policy':>14} {'compiles':>8} {'waste':>8}  buckets")
    for name, (sizes, static) in dists.items():
        feature = {"ids": sizes}
        rows = [("static", [static]), ("powers of two", None)]
        for k in (2, 4, 8):
            rows.append((f"suggested {k}", list(suggest_buckets(feature, max_buckets=k).buckets["ids"])))
        for policy, buckets in rows:
            compiles = len({bucketize(n, buckets) for n in sizes})
            waste = padding_waste(feature, buckets)
            shown = "" if buckets is None else str(buckets)
            print(f"{name:>13} {policy:>14} {compiles:>8} {waste:>8.1%}  {shown}")


if __name__ == "__main__":
    main()
