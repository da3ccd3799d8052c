"""A compiled step takes TorchRec KeyedJaggedTensors as they are; BucketedStep compiles once per bucket
and trains like the reference interpreter."""

from __future__ import annotations

import pytest
import recir.embedding as emb
import recir.lower_gpu as lg
import torch
from recir.capture import BucketedStep
from torch import nn


def _model() -> nn.Module:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=30, feature_names=["a", "b"])
                ]
            )
            self.fc = nn.Linear(8, 1)

        def forward(self, kjt):
            return self.fc(self.ebc(kjt).values()).squeeze(-1)

    return M()


def _loss(model, batch):
    return (model(batch["kjt"]) - batch["y"]).pow(2).mean()


def _batches(n: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        most = 3 if i % 2 == 0 else 6  # two buckets: up to 12 and up to 24 ids per feature
        lengths = torch.randint(0, most + 1, (8,), generator=gen)
        values = torch.randint(0, 30, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor(keys=["a", "b"], values=values, lengths=lengths)
        out.append({"kjt": kjt, "y": torch.randn(4, generator=gen)})
    return out


def test_bucketed_compiled_step_trains_on_kjts_like_the_interpreter(lower_gpu_cache_dir):
    batches = _batches(4)
    results = []
    for compile_fn in (
        None,
        lambda s: lg.compile(s, device="cpu", options=lg.GPUOptions(cache_dir=lower_gpu_cache_dir)),
    ):
        model = _model()
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
        trainer = BucketedStep(model, opt, _loss, compile=compile_fn, overrides=emb.overrides())
        state = trainer.init_state(batches[0])
        losses = []
        for b in batches:
            state, (loss,) = trainer(state, b)
            losses.append(float(loss))
        results.append((losses, trainer.compiles, next(iter(trainer._steps.values())).state_dict(state)))
    (ref_losses, ref_compiles, ref_state), (losses, compiles, got_state) = results
    assert compiles == ref_compiles == 2
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for name, value in ref_state.items():
        torch.testing.assert_close(got_state[name], value, rtol=1e-5, atol=1e-6, msg=name)
