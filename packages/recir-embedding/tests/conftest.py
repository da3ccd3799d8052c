"""Fixtures for recir-embedding tests: a TorchRec model, its plain-PyTorch twin and random jagged batches.

The twin (``nn.EmbeddingBag``/``nn.Embedding`` trained eagerly with torch.optim) is the reference every
backend is compared against; ``eager_rowwise_adagrad`` is FBGEMM's RowWiseAdagrad maths in eager.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn

B = 4
BUCKET = 16  # every feature padded to 16 ids: one captured shape for all batches
T1_ROWS, T2_ROWS, S1_ROWS = 20, 12, 15


def make_torchrec_model(seed: int = 0) -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    torch.manual_seed(seed)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    # t1 is shared by f1 and f2 (sum); t2 pools f3 by mean
                    EmbeddingBagConfig(
                        name="t1", embedding_dim=4, num_embeddings=T1_ROWS, feature_names=["f1", "f2"]
                    ),
                    EmbeddingBagConfig(
                        name="t2",
                        embedding_dim=3,
                        num_embeddings=T2_ROWS,
                        feature_names=["f3"],
                        pooling=PoolingType.MEAN,
                    ),
                ]
            )
            self.ec = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(name="s1", embedding_dim=4, num_embeddings=S1_ROWS, feature_names=["q"])
                ]
            )

        def forward(self, features: Any) -> tuple[torch.Tensor, torch.Tensor]:
            return self.ebc(features).values(), self.ec(features)["q"].values()

    return Model()


def loss_fn(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    pooled, seq = model(batch["features"])
    return (pooled.tanh().sum(1) - batch["y"]).pow(2).mean() + seq.sin().sum() * 0.1


class PlainModel(nn.Module):
    """The same maths with nn.EmbeddingBag / nn.Embedding (the eager reference)."""

    def __init__(self, tr: nn.Module, sparse: bool) -> None:
        super().__init__()
        self.t1 = nn.EmbeddingBag(T1_ROWS, 4, mode="sum", sparse=sparse)
        self.t2 = nn.EmbeddingBag(T2_ROWS, 3, mode="mean", sparse=sparse)
        self.s1 = nn.Embedding(S1_ROWS, 4, sparse=sparse)
        with torch.no_grad():
            self.t1.weight.copy_(tr.ebc.embedding_bags["t1"].weight)
            self.t2.weight.copy_(tr.ebc.embedding_bags["t2"].weight)
            self.s1.weight.copy_(tr.ec.embeddings["s1"].weight)

    def forward(self, kjt: Any) -> tuple[torch.Tensor, torch.Tensor]:
        d = kjt.to_dict()

        def bag(mod: nn.EmbeddingBag, f: str) -> torch.Tensor:
            return mod(
                d[f].values(), torch.cat([torch.zeros(1, dtype=torch.int64), d[f].lengths().cumsum(0)])[:-1]
            )

        pooled = torch.cat([bag(self.t1, "f1"), bag(self.t1, "f2"), bag(self.t2, "f3")], dim=1)
        return pooled, self.s1(d["q"].values())


NAMES = {
    "t1": "ebc.embedding_bags.t1.weight",
    "t2": "ebc.embedding_bags.t2.weight",
    "s1": "ec.embeddings.s1.weight",
}


def random_kjt(gen: torch.Generator, batch_size: int = B) -> Any:
    """Random lengths 0..3 per sample; ids drawn from half of each table, so repeats are common."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    rows = {"f1": T1_ROWS, "f2": T1_ROWS, "f3": T2_ROWS, "q": S1_ROWS}
    lengths, values = [], []
    for r in rows.values():
        ln = torch.randint(0, 4, (batch_size,), generator=gen)
        lengths.append(ln)
        values.append(torch.randint(0, r // 2, (int(ln.sum()),), generator=gen))
    return KeyedJaggedTensor(keys=list(rows), values=torch.cat(values), lengths=torch.cat(lengths))


def random_batch(gen: torch.Generator) -> tuple[dict[str, Any], Any]:
    """``({"features": JaggedBatch, "y": [B]}, the KJT)``."""
    from recir.embedding import pad_to_bucket

    kjt = random_kjt(gen)
    jb, _ = pad_to_bucket(kjt, [BUCKET])
    return {"features": jb, "y": torch.randn(B, generator=gen)}, kjt


class EagerRowWiseAdagrad(torch.optim.Optimizer):
    """FBGEMM's RowWiseAdagrad in eager: ``m[r] += mean(g[r]^2); w[r] -= lr g[r] / (sqrt(m[r]) + eps)``."""

    def __init__(self, params: Any, lr: float, eps: float = 1e-8) -> None:
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("sum", torch.zeros(p.shape[0]))
                g = p.grad
                st["sum"] += (g * g).mean(1)
                p -= group["lr"] * g / (st["sum"].sqrt() + group["eps"]).unsqueeze(1)


@dataclasses.dataclass
class Reference:
    model: PlainModel
    opt: torch.optim.Optimizer

    def step(self, kjt: Any, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad()
        pooled, seq = self.model(kjt)
        loss = (pooled.tanh().sum(1) - y).pow(2).mean() + seq.sin().sum() * 0.1
        loss.backward()
        self.opt.step()
        return loss.detach()

    def state_of(self, table: str) -> dict[str, torch.Tensor]:
        p = getattr(self.model, table).weight
        out = {f"param:{NAMES[table]}": p.detach()}
        for k, v in self.opt.state.get(p, {}).items():
            if k != "step":
                out[f"optim:{NAMES[table]}:{k}"] = v
        return out


def make_reference(tr: nn.Module, kind: str, hp: dict[str, Any]) -> Reference:
    model = PlainModel(tr, sparse=kind == "adam")
    if kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=hp["lr"])
    elif kind == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=hp["lr"], eps=hp["eps"])
    elif kind == "rowwise_adagrad":
        opt = EagerRowWiseAdagrad(model.parameters(), lr=hp["lr"], eps=hp["eps"])
    else:  # lazy Adam is SparseAdam's maths
        opt = torch.optim.SparseAdam(list(model.parameters()), lr=hp["lr"], betas=hp["betas"], eps=hp["eps"])
    return Reference(model, opt)


@pytest.fixture
def helpers() -> Any:
    import types

    return types.SimpleNamespace(
        make_torchrec_model=make_torchrec_model,
        loss_fn=loss_fn,
        random_kjt=random_kjt,
        random_batch=random_batch,
        make_reference=make_reference,
        NAMES=NAMES,
        B=B,
        BUCKET=BUCKET,
    )
