"""A TorchRec two-tower ranking model trained through RecIR's libraries, not recir-dlrmv3: captured once,
compiled on the GPU path (Inductor; the CPU device without CUDA), checkpointed every N steps, and resumed
from the latest checkpoint bit for bit. Run it twice with the same --checkpoint_dir to see it resume:

    python -m recir.examples.two_tower.train --steps 10 --checkpoint_dir /tmp/two_tower
    python -m recir.examples.two_tower.train --steps 20 --checkpoint_dir /tmp/two_tower
"""

from __future__ import annotations

import argparse
import functools

import recir.embedding as emb
import recir.lower_gpu as lg
import torch
from recir.capture import BucketedStep
from recir.distributed import CheckpointManager, checkpoint_meta, load_resharded
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

ROWS = {"user_id": 1000, "item_id": 5000, "history": 5000}  # feature -> rows of its table


class TwoTower(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        table = functools.partial(EmbeddingBagConfig, embedding_dim=dim)
        users = table(name="user_table", num_embeddings=1000, feature_names=["user_id"])
        items = table(name="item_table", num_embeddings=5000, feature_names=["item_id", "history"])
        self.ebc = EmbeddingBagCollection(tables=[users, items])
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.mlp(self.ebc(sparse).values()).squeeze(-1)


def loss_fn(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["sparse"])
    return nn.functional.binary_cross_entropy_with_logits(logits, batch["label"]), logits


def make_batch(i: int, size: int = 32) -> dict:
    """Synthetic batch ``i``: one user and one item id per sample, a history of 0-8 items, a click label."""
    g = torch.Generator().manual_seed(i)
    lengths = [torch.ones(size, dtype=torch.long)] * 2 + [torch.randint(0, 9, (size,), generator=g)]
    values = [torch.randint(0, rows, (int(n.sum()),), generator=g) for rows, n in zip(ROWS.values(), lengths)]
    sparse = KeyedJaggedTensor(keys=list(ROWS), values=torch.cat(values), lengths=torch.cat(lengths))
    return {"sparse": sparse, "label": torch.randint(0, 2, (size,), generator=g).float()}


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train until this many steps are done")
    parser.add_argument("--checkpoint_dir", required=True, help="resumes from the latest checkpoint here")
    parser.add_argument("--checkpoint_every", type=int, default=5)
    sizes = lambda s: s if s == "auto" else [int(b) for b in s.split(",")]  # noqa: E731 - bad: usage error
    auto = "comma-separated, or 'auto' (powers of two for 8 batches, then suggest_buckets' buckets)"
    parser.add_argument("--buckets", type=sizes, default="256", help=f"ids per feature to pad to, {auto}")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TwoTower()
    dense, tables = model.mlp.parameters(), model.ebc.parameters()
    optimizers = [torch.optim.Adam(dense, lr=1e-3), emb.RowWiseAdagrad(tables, lr=0.05)]
    buckets = emb.AutoBuckets(8) if args.buckets == "auto" else args.buckets
    compile_fn = functools.partial(lg.compile, device="cuda" if torch.cuda.is_available() else "cpu")
    trainer = BucketedStep(
        model, optimizers, loss_fn, compile=compile_fn, overrides=emb.overrides(), batch_buckets=buckets
    )
    state, done = trainer.init_state(make_batch(0)), 0
    checkpoints = CheckpointManager(args.checkpoint_dir, existing="continue")
    if (latest := checkpoints.latest()) is not None:
        state, done = trainer.load_state_dict(load_resharded(latest, None)), checkpoint_meta(latest)["step"]
        print(f"resumed from {latest} (step {done})")
    losses = []
    for i in range(done, args.steps):
        state, (loss, _) = trainer(state, make_batch(i))
        losses.append(float(loss))
        print(f"step {i + 1}: loss {losses[-1]:.6f}", flush=True)
        if (i + 1) % args.checkpoint_every == 0 or i + 1 == args.steps:
            checkpoints.save(i + 1, trainer.state_dict(state))
    if trainer.batches:  # bucket feedback: what padding cost, and the buckets that would pad least
        print(
            f"padding waste {trainer.padding_waste:.1%} over {trainer.batches} batches, {trainer.compiles} compiles"
        )
        policy = buckets.buckets if isinstance(buckets, emb.AutoBuckets) else buckets
        print(emb.suggest_buckets(trainer.sizes, current=policy))
    return losses


if __name__ == "__main__":
    main()
