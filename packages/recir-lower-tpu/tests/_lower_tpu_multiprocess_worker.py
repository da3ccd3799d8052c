"""One process of a multi-process JAX job (run by test_lower_tpu_multiprocess.py, not by pytest itself).

Usage: python _lower_tpu_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR. Each process has
XLA_FLAGS=--xla_force_host_platform_device_count=4 (set by the test): two processes make one 8-device
mesh. Every process captures the same TorchRec model, compiles it with a hybrid plan (dense data-parallel,
tables row-wise over the mesh) and trains 10 global steps; each checks the gathered state against the
single-process StepGraph interpreter and writes what it measured to OUT_DIR/process<i>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

B, STEPS, ROWS = 16, 10, {"user": 32, "item": 16}


class Model(nn.Module):
    def __init__(self) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="t_user", embedding_dim=4, num_embeddings=32, feature_names=["user"]),
                EmbeddingBagConfig(
                    name="t_item",
                    embedding_dim=4,
                    num_embeddings=16,
                    feature_names=["item"],
                    pooling=PoolingType.MEAN,
                ),
            ]
        )
        self.fc = nn.Linear(11, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, b: dict[str, Any]) -> torch.Tensor:
        pooled = self.ebc(b["features"]).values()
        return self.head(torch.relu(self.fc(torch.cat([pooled, b["dense"]], 1)))).squeeze(1)


def loss_fn(model: nn.Module, b: dict[str, Any]) -> torch.Tensor:
    return ((model(b) - b["y"]) ** 2).mean()


def batch(k: int) -> dict[str, Any]:
    from recir.embedding import pad_to_bucket
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(100 + k)
    lengths = [torch.randint(0, 4, (B,), generator=g) for _ in ROWS]
    values = [torch.randint(0, r, (int(ln.sum()),), generator=g) for ln, r in zip(lengths, ROWS.values())]
    kjt = KeyedJaggedTensor(keys=list(ROWS), values=torch.cat(values), lengths=torch.cat(lengths))
    jb, _ = pad_to_bucket(kjt, [64])
    return {"features": jb, "dense": torch.randn(B, 3, generator=g), "y": torch.randn(B, generator=g)}


def main(pid: int, nproc: int, port: int, out: Path) -> None:
    import recir.distributed as rd
    from recir.capture import capture_train_step
    from recir.embedding import overrides
    from recir.lower_tpu import compile, initialize_distributed, sync_processes

    index, count = initialize_distributed(f"127.0.0.1:{port}", nproc, pid)
    import jax

    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)  # exact under sparse row-wise updates
    step = capture_train_step(model, opt, loss_fn, batch(0), overrides=overrides())
    plan = rd.plan(step, rd.HybridParallel(tables=rd.row_wise()), rd.Mesh(axes={"data": 8}), batch="global")
    compiled = compile(step, plan)
    state = compiled.init_state(model, opt)
    ref = step.init_state(model, opt)
    losses, ref_losses = [], []
    for k in range(STEPS):
        state, (loss,) = compiled(state, batch(k))
        ref, (ref_loss,) = step(ref, batch(k))
        losses.append(float(loss))
        ref_losses.append(float(ref_loss))
    table = next(i for i, s in enumerate(step.signature.state) if s.name.endswith("t_user.weight"))
    x = state[table]
    local_bytes = sum(s.data.nbytes for s in x.addressable_shards)
    got = compiled.state_dict(state)  # gathers the row-sharded tables from both processes
    want = step.state_dict(ref)
    diffs = {name: float((got[name].float() - want[name].float()).abs().max()) for name in want}
    sync_processes("recir-test-done")
    (out / f"process{pid}.json").write_text(
        json.dumps(
            {
                "index": index,
                "count": count,
                "global_devices": jax.device_count(),
                "local_devices": jax.local_device_count(),
                "table_fully_addressable": bool(x.is_fully_addressable),
                "table_local_bytes": local_bytes,
                "table_bytes": int(x.size * x.dtype.itemsize),
                "losses": losses,
                "ref_losses": ref_losses,
                "state_diffs": diffs,
                "slots": sorted(want),
            }
        )
    )


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
