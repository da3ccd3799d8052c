"""Per-device memory and communication of each parallel mode, from the sharding plan and the per-device graph.

Not a test: `uv run python benchmarks/distributed.py [--rows 98304 --dim 64 --tables 4 --batch 256]`.
Nothing runs on devices: capture and distribution work on fake tensors (only the model is allocated once). Bytes
are per device and per step (the largest device where devices differ); `comm` is what one device sends.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

os.environ.setdefault("RECIR_VERIFY", "0")


class DLRMLike(nn.Module):
    """Pooled tables (nn.EmbeddingBag, sum) + dense features -> an MLP over the concatenation."""

    def __init__(self, tables: int, rows: int, dim: int, dense: int, hidden: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            [nn.EmbeddingBag(rows, dim, mode="sum", include_last_offset=True) for _ in range(tables)]
        )
        self.mlp = nn.Sequential(
            nn.Linear(tables * dim + dense, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pooled = [t(batch[f"ids{i}"], batch[f"offsets{i}"]) for i, t in enumerate(self.tables)]
        return self.mlp(torch.cat([*pooled, batch["dense"]], 1)).squeeze(1)


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(batch), batch["label"])


def _batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    b, n = args.batch, args.batch * args.ids_per_sample
    out = {"dense": torch.randn(b, args.dense), "label": torch.rand(b)}
    for i in range(args.tables):
        out[f"ids{i}"] = torch.randint(0, args.rows, (n,))
        out[f"offsets{i}"] = torch.arange(0, n + 1, args.ids_per_sample)
    return out


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--rows", type=int, default=98304)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dense", type=int, default=13)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256, help="samples per device")
    parser.add_argument("--ids-per-sample", type=int, default=4)
    parser.add_argument("--worlds", default="1,2,4,8")
    args = parser.parse_args()

    import recir.distributed as rd
    from recir.capture import capture_train_step
    from recir.embedding import EmbeddingBagOverride

    model = DLRMLike(args.tables, args.rows, args.dim, args.dense, args.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = capture_train_step(model, opt, _loss, _batch(args), overrides=[EmbeddingBagOverride()])
    modes = {
        "data_parallel": rd.DataParallel(),
        "fsdp": rd.FullyShardedDataParallel(),
        "table_wise": rd.table_wise(),
        "row_wise": rd.row_wise(),
        "column_wise": rd.column_wise(),
    }
    print(
        f"{args.tables} tables x {args.rows} x {args.dim}, MLP hidden {args.hidden}, Adam; "
        f"{args.batch} samples x {args.ids_per_sample} ids per table per device\n"
    )
    header = f"{'mode':<14}{'world':>6}{'params':>12}{'optim':>12}{'comm/step':>12}  comm by collective"
    print(header)
    print("-" * len(header))
    for world in [int(w) for w in args.worlds.split(",")]:
        for name, mode in modes.items():
            if world == 1 and name != "data_parallel":
                continue
            plan = rd.plan(step, mode, rd.Mesh(axes={"data": world}))
            params = max(plan.bytes_per_device(["param"]))
            optim = max(plan.bytes_per_device(["optim"]))
            comm: dict[str, int] = {}
            ranks = range(world) if name == "table_wise" else [0]  # the others are symmetric
            for rank in ranks:
                per = rd.communication_bytes(rd.distribute(step, plan, rank)) if world > 1 else {}
                if sum(per.values()) >= sum(comm.values()):
                    comm = per
            label = "single device" if world == 1 else name
            detail = ", ".join(f"{k} {_fmt(v)}" for k, v in sorted(comm.items())) or "-"
            print(
                f"{label:<14}{world:>6}{_fmt(params):>12}{_fmt(optim):>12}{_fmt(sum(comm.values())):>12}  {detail}"
            )
    print(
        "\nall_reduce counts 2x its input (reduce-scatter + all-gather of a ring); row- and column-wise "
        "send every id to every device (even splits), table-wise only to the owner."
    )


if __name__ == "__main__":
    main()
