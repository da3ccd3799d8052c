"""`--target tpu --embedding_backend cpu`: DLRMv3's tables and their row-wise Adagrad state on the host,
the rest of the step through JAX; step for step the same training as `--embedding_backend in_graph`."""

import pytest
import torch
from recir.dlrmv3 import TrainOptions
from recir.dlrmv3._train import build
from recir.dlrmv3._trainers import make_trainer

TINY = dict(batch_size=4, embedding_dim=16, num_layers=1, num_heads=2, uih_len=8, num_candidates=3,
            hash_size=200, num_threads=1)  # fmt: skip
STEPS = 4


@pytest.mark.tpu
@pytest.mark.parametrize("mesh", [None, "data=8"])
def test_dlrmv3_host_tables_train_like_in_graph(mesh):
    if mesh is not None:
        import jax

        if len(jax.devices()) < 8:
            pytest.skip("needs 8 JAX devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    from recir.distributed import Mesh

    runs = {}
    for backend in ("cpu", "in_graph"):
        tiny = {**TINY, "batch_size": 8} if mesh else TINY
        opts = TrainOptions(**tiny, target="tpu", embedding_backend=backend, mesh=mesh)  # type: ignore[arg-type]
        model, data, optimizers = build(opts)
        parallel = "dp" if mesh else "none"
        trainer = make_trainer(
            "tpu", model, optimizers, data.train_batch(0), backend, parallel, mesh and Mesh.parse(mesh)
        )
        losses = [float(trainer.step(data.train_batch(i))[0]) for i in range(STEPS)]
        runs[backend] = (trainer, losses, trainer.state_dict())
    host, losses, got = runs["cpu"]
    _, ref_losses, want = runs["in_graph"]
    tables = host.compiled.split.tables  # type: ignore[attr-defined]
    assert tables and all(name.startswith("param:") for name in tables), tables
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert sorted(got) == sorted(want)
    bad = {k: float((got[k].double() - want[k].double()).abs().max()) for k in want
           if got[k].numel() and not torch.allclose(got[k].double(), want[k].double(), rtol=0, atol=1e-5)}  # fmt: skip
    assert not bad, f"after {STEPS} steps these slots differ (max abs error): {bad}"
    # the tables did train (rows the batches touched moved)
    table = next(iter(tables))
    assert not torch.equal(got[table], host.model.get_parameter(table.removeprefix("param:")).detach())
