"""The four reference models (MLP, transformer block, EmbeddingBag + MLP, BatchNorm) and their optimizers.

Shared by capture's and the lowerings' 20-step parity tests: build a case, capture it, run the step
and eager torch.optim side by side, and compare every parameter, buffer and optimizer state tensor.
The "embedding_bag" case's override and the "rowwise_adagrad" optimizer come from recir-embedding (see
``_embedding_bag_overrides``): capture itself depends on torch and recir-transforms alone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from recir.transforms import STEP_SLOT, buffer_slot, grad_of, lr_slot, optim_slot, param_slot
from torch import Tensor, nn

from ._optim_map import all_param_groups, as_optimizer_list


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 1) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(x)))))


class TransformerBlock(nn.Module):
    """Pre-LN attention block (``F.scaled_dot_product_attention``) + GELU MLP, then a pooled scalar head."""

    def __init__(self, d: int = 16, heads: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # a key bias has an exactly-zero gradient
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, s, d)))
        x = x + self.drop(self.mlp(self.ln2(x)))
        return self.head(x.mean(dim=1)).squeeze(-1)


class ServingModel(nn.Module):
    """A table, dense features and dropout into two logits: the serving-graph/export tests' model
    (``serving_loss`` returns ``(loss, logits)``, so ``to_inference(step, "aux.0")`` keeps the logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(20, 4, mode="sum")
        self.fc = nn.Linear(4 + 3, 2)
        self.drop = nn.Dropout(0.3)

    def forward(self, ids: Tensor, offsets: Tensor, dense: Tensor) -> Tensor:
        return self.fc(self.drop(torch.cat([self.emb(ids, offsets), dense], 1)))


def serving_loss(model: nn.Module, b: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    logits = model(b["ids"], b["offsets"], b["dense"])
    return F.cross_entropy(logits, b["y"]), logits


def serving_batch() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.tensor([1, 5, 7, 3]), "offsets": torch.tensor([0, 2]), "dense": torch.randn(2, 3, generator=g),
            "y": torch.tensor([0, 1])}  # fmt: skip


class EmbeddingBagModel(nn.Module):
    """Two ``nn.EmbeddingBag`` tables (sum with offsets and per-sample weights; mean over 2-D ids) + MLP."""

    def __init__(self, rows: int = 20, dim: int = 8, dense: int = 4) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            [nn.EmbeddingBag(rows, dim, mode="sum"), nn.EmbeddingBag(rows, dim, mode="mean")]
        )
        self.bottom = nn.Linear(dense, dim)
        self.top = nn.Sequential(nn.Linear(3 * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: Mapping[str, Tensor]) -> Tensor:
        e0 = self.tables[0](batch["ids_0"], batch["offsets_0"], per_sample_weights=batch["weights_0"])
        e1 = self.tables[1](batch["ids_1"])
        d = F.relu(self.bottom(batch["dense"]))
        return self.top(torch.cat([e0, e1, d], dim=1)).squeeze(-1)


class BatchNormModel(nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 12) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, hidden, bias=False)  # BatchNorm cancels a bias: its gradient is zero
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(F.relu(self.bn(self.fc(x))))


def _regression_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> Tensor:
    return F.mse_loss(model(batch["x"]).reshape(-1), batch["y"])


def _ctr_loss(model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    logits = model(batch)
    loss = F.binary_cross_entropy_with_logits(logits, batch["label"])
    return loss, torch.sigmoid(logits).detach()


def _dense_batch(shape: tuple[int, ...]) -> Callable[[int], dict[str, Tensor]]:
    def make(seed: int) -> dict[str, Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(*shape, generator=g), "y": torch.randn(shape[0], generator=g)}

    return make


def _ctr_batch(seed: int, bags: int = 4, rows: int = 20) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 1, 2, 2])[:bags]
    n = int(lengths.sum())
    return {
        "dense": torch.randn(bags, 4, generator=g),
        "ids_0": torch.randint(0, rows, (n,), generator=g),
        "offsets_0": torch.cumsum(lengths, 0) - lengths,
        "weights_0": torch.rand(n, generator=g),
        "ids_1": torch.randint(0, rows, (bags, 3), generator=g),
        "label": torch.randint(0, 2, (bags,), generator=g).float(),
    }


@dataclasses.dataclass(frozen=True)
class ReferenceCase:
    """A model factory, its loss_fn, a seeded batch factory and the overrides capture needs."""

    name: str
    make_model: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module, Any], Any]
    make_batch: Callable[[int], Any]
    overrides: Callable[[], tuple[Any, ...]] = tuple

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.make_model()


# The zoo's embedding cases use recir-embedding at test time only: it is imported here, when a test calls
# these, so importing recir.capture (or recir.capture.testing) never imports recir.embedding.
def _embedding_bag_overrides() -> tuple[Any, ...]:
    from recir.embedding import EmbeddingBagOverride

    return (EmbeddingBagOverride(),)


def _rowwise_adagrad(params: Any) -> torch.optim.Optimizer:
    from recir.embedding import RowWiseAdagrad

    return RowWiseAdagrad(params, lr=0.05, eps=1e-8)


REFERENCE_CASES: dict[str, ReferenceCase] = {
    "mlp": ReferenceCase("mlp", MLP, _regression_loss, _dense_batch((4, 8))),
    "transformer": ReferenceCase("transformer", TransformerBlock, _regression_loss, _dense_batch((2, 5, 16))),
    "embedding_bag": ReferenceCase(
        "embedding_bag", EmbeddingBagModel, _ctr_loss, _ctr_batch, _embedding_bag_overrides
    ),
    "batchnorm": ReferenceCase("batchnorm", BatchNormModel, _regression_loss, _dense_batch((6, 6))),
}

#: Optimizer configurations by name; each covers a distinct branch of torch.optim's maths.
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.02),
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9, nesterov=True),
    "sgd_dampening_maximize": lambda ps: torch.optim.SGD(
        ps, lr=1e-3, momentum=0.8, dampening=0.3, maximize=True
    ),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam_wd_maximize": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.05, maximize=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05, amsgrad=True),
    "adagrad": lambda ps: torch.optim.Adagrad(
        ps, lr=0.05, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1
    ),
    "rowwise_adagrad": _rowwise_adagrad,
}


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    return OPTIMIZERS[name](params)


def eager_step(model: nn.Module, optimizer: Any, loss_fn: Callable[..., Any], batch: Any) -> Tensor:
    """One ordinary eager step: ``loss.backward(); opt.step(); opt.zero_grad()`` (each optimizer of a list)."""
    result = loss_fn(model, batch)
    loss = result[0] if isinstance(result, (tuple, list)) else result
    loss.backward()
    for opt in as_optimizer_list(optimizer):
        opt.step()
        opt.zero_grad()
    return loss.detach()


def eager_state_dict(model: nn.Module, optimizer: Any) -> dict[str, Tensor]:
    """The eager model and optimizer(s) as a StepGraph-style name -> tensor mapping (step as float32)."""
    out: dict[str, Tensor] = {param_slot(n): p.detach() for n, p in model.named_parameters()}
    out |= {buffer_slot(n): b for n, b in model.named_buffers()}
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in as_optimizer_list(optimizer):
        for p, st in opt.state.items():
            for k, v in st.items():
                if k == "step":
                    out[STEP_SLOT] = torch.as_tensor(v, dtype=torch.float32)
                elif isinstance(v, Tensor):
                    out[optim_slot(names[id(p)], k)] = v
    for i, g in enumerate(all_param_groups(optimizer)):
        out[lr_slot(i)] = torch.tensor(float(g["lr"]))
    return out


def state_mismatches(
    captured: Mapping[str, Tensor], eager: Mapping[str, Tensor], *, rtol: float, atol: float
) -> dict[str, float]:
    """Slots (present in both, rng excluded) whose values differ beyond ``rtol``/``atol``: name -> max abs error."""
    bad = {}
    for name, ref in eager.items():
        if name not in captured:
            continue
        got = captured[name].detach().to(device=ref.device, dtype=ref.dtype).reshape(ref.shape)
        if not torch.allclose(got, ref, rtol=rtol, atol=atol):
            bad[name] = float((got.double() - ref.double()).abs().max())
    return bad


def clone_pair(model: nn.Module, optimizer_name: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A deep copy of ``model`` with a fresh optimizer of the named configuration."""
    twin = copy.deepcopy(model)
    return twin, make_optimizer(optimizer_name, twin.parameters())


def captured_gradients(step: Any, state: Any, batch: Any) -> dict[str, Tensor]:
    """Run a captured StepGraph once and return ``param slot -> gradient`` (the ``recir.grad_of`` nodes)."""
    import torch.fx as fx

    grads: dict[str, Tensor] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            slot = grad_of(n)
            if slot is not None:
                grads[slot] = value.detach().clone()
            return value

    flat = step.signature.flatten_batch(batch)
    _Recorder(step.graph_module).run(*state, *flat)
    return grads


def eager_gradients(model: nn.Module, loss_fn: Callable[..., Any], batch: Any) -> dict[str, Tensor]:
    """``param slot -> .grad`` of one eager backward, run on a copy (buffers such as BatchNorm stats stay put)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    result = loss_fn(model, batch)
    loss = result[0] if isinstance(result, (tuple, list)) else result
    loss.backward()
    return {param_slot(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
