"""recir-embed-sparsify-update on plain ``nn.Embedding`` / ``nn.EmbeddingBag`` tables (no TorchRec, no
override): capture traces them as ATen ops, and their gradients (``embedding_dense_backward``
decomposed to ``zeros.index_put([ids], g, accumulate=True)``; ``_embedding_bag_backward`` kept whole)
become the same O(ids) row-wise updates as the override ops'.

Parity is against eager ``torch.optim`` through ``recir.lower_gpu.compile`` on the CPU device (one
Inductor compile per optimizer, 5-30 s each on 2 shared cores). Tolerances (rtol=1e-4, atol=1e-5) as in
recir-lower-gpu's parity tests: Inductor reorders float32 arithmetic by a few ulps per step, while a
wrong row update (a lost padding mask, a missing 1/bag-size, a dropped term) is off by >1e-3 at once.
"""

from __future__ import annotations

import logging

import pytest
import torch
from recir.capture import capture_train_step
from recir.capture.testing import eager_state_dict, eager_step, state_mismatches
from recir.embedding import RowWiseAdagrad, prepare_for_lowering
from recir.transforms import PHASE_KEY
from torch import nn

aten = torch.ops.aten
ROWS, D, B = 50, 4, 4
RTOL, ATOL = 1e-4, 1e-5
STEPS = 10
TABLES = ["param:emb.weight", "param:bag_sum.weight", "param:bag_mean.weight"]


class PlainTables(nn.Module):
    """``nn.Embedding`` (padding_idx 0) over [B, 3] ids, ``nn.EmbeddingBag`` sum (1-D ids + offsets with
    an empty bag, per-sample weights) and mean (2-D ids, padding_idx 1), then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, D, padding_idx=0)
        self.bag_sum = nn.EmbeddingBag(ROWS, D, mode="sum")
        self.bag_mean = nn.EmbeddingBag(ROWS, D, mode="mean", padding_idx=1)
        self.head = nn.Linear(3 * D, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        e = self.emb(b["seq"]).sum(1)
        s = self.bag_sum(b["ids"], b["offsets"], per_sample_weights=b["psw"])
        m = self.bag_mean(b["ids2"])
        return self.head(torch.cat([e, s, m], 1)).squeeze(-1)


def loss_fn(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return (model(b) - b["y"]).pow(2).mean()


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, ROWS, (B, 3), generator=g)
    seq[0, 0] = 0  # padding: no gradient
    ids2 = torch.randint(0, ROWS, (B, 3), generator=g)
    ids2[1, 0] = 1
    ids2[2] = 1  # a bag of padding only: mean over no ids
    ids = torch.randint(0, ROWS, (8,), generator=g)
    ids[1] = ids[0]  # a row twice in one bag
    return {
        "seq": seq,
        "ids": ids,
        "offsets": torch.tensor([0, 3, 3, 6]),  # bag 1 is empty
        "psw": torch.rand(8, generator=g),
        "ids2": ids2,
        "y": torch.randn(B, generator=g),
    }


# Row-wise exact optimizers (no weight decay: lazy weight decay reaches touched rows only).
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
    "rowwise_adagrad": lambda ps: RowWiseAdagrad(ps, lr=0.1, eps=1e-8),
}


def _model_and_twin(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = PlainTables()
    twin = PlainTables()
    twin.load_state_dict(model.state_dict())
    return model, twin


def _dense_table_work(step) -> list[str]:
    """Backward/optimizer nodes that still build a [ROWS, D] gradient (what makes a step O(rows))."""
    out = []
    for n in step.graph.nodes:
        if n.target == aten._embedding_bag_backward.default:
            out.append(n.name)
        elif n.meta.get(PHASE_KEY) == "backward" and n.target in (
            aten.index_put.default,
            aten.full.default,
        ):
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and tuple(val.shape) == (ROWS, D):
                out.append(n.name)
    return out


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_plain_tables_sparsified_and_match_eager_through_lower_gpu(opt_name, tmp_path, caplog):
    lower_gpu = pytest.importorskip("recir.lower_gpu")
    model, twin = _model_and_twin()
    opt = OPTIMIZERS[opt_name](model.parameters())
    ref_opt = OPTIMIZERS[opt_name](twin.parameters())
    step = capture_train_step(model, opt, loss_fn, make_batch(0))
    assert _dense_table_work(step), "the captured step builds dense [rows, D] table gradients"
    options = lower_gpu.GPUOptions(cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="recir.embedding"):
        compiled = lower_gpu.compile(step, device="cpu", embedding_backend="in_graph", options=options)
    sparsify = compiled.step.meta["recir.embedding"]["sparsify"]
    assert sorted(sparsify["sparsified"]) == sorted(TABLES), sparsify
    assert sparsify["dense_tables"] == {} and not _warnings(caplog)
    assert sparsify["ids"] == {TABLES[0]: B * 3, TABLES[1]: 8, TABLES[2]: B * 3}
    assert not _dense_table_work(compiled.step)

    state = compiled.init_state(model, opt)
    for i in range(STEPS):
        batch = make_batch(i)
        state, (loss, *_) = compiled(state, batch)
        ref_loss = eager_step(twin, ref_opt, loss_fn, batch)
        torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    got, want = compiled.state_dict(state), eager_state_dict(twin, ref_opt)
    compared = [k for k in want if k in got and not k.startswith("optim:group")]
    assert {f"optim:{t[len('param:') :]}:sum" for t in TABLES} <= set(compared) or opt_name == "sgd"
    assert set(TABLES) <= set(compared)
    assert state_mismatches(got, want, rtol=RTOL, atol=ATOL) == {}
    # rows at padding_idx never get a gradient: they keep their initial values
    torch.testing.assert_close(got["param:emb.weight"][0], model.emb.weight[0].detach())
    torch.testing.assert_close(got["param:bag_mean.weight"][1], model.bag_mean.weight[1].detach())


@pytest.mark.tpu
def test_plain_tables_sparsified_and_match_eager_through_lower_tpu():
    """The TPU path (torchax, JAX's CPU backend here) runs the same row-wise updates: RowWiseAdagrad."""
    lower_tpu = pytest.importorskip("recir.lower_tpu")
    model, twin = _model_and_twin()
    opt = OPTIMIZERS["rowwise_adagrad"](model.parameters())
    ref_opt = OPTIMIZERS["rowwise_adagrad"](twin.parameters())
    compiled = lower_tpu.compile(capture_train_step(model, opt, loss_fn, make_batch(0)))
    assert sorted(compiled.step.meta["recir.embedding"]["sparsify"]["sparsified"]) == sorted(TABLES)
    state = compiled.init_state(model, opt)
    for i in range(STEPS):
        state, _ = compiled(state, make_batch(i))
        eager_step(twin, ref_opt, loss_fn, make_batch(i))
    got, want = compiled.state_dict(state), eager_state_dict(twin, ref_opt)
    assert {f"optim:{t[len('param:') :]}:sum" for t in TABLES} <= set(got)
    assert state_mismatches(got, want, rtol=RTOL, atol=ATOL) == {}


def test_plain_tables_adam_is_lazy_like_sparse_adam():
    """Sparse updates make Adam lazy: rows absent from a batch keep weights and moments (dense Adam
    decays every row's moments and keeps moving rows it once touched). The reference is eager
    ``torch.optim.SparseAdam`` on ``sparse=True`` copies of the tables (plus Adam on the head), which
    has those semantics. Its epsilon differs slightly (it adds ``eps`` to ``sqrt(v)`` before the bias
    correction ``sqrt(1 - beta2^t)``, torch.optim.Adam after), an O(eps) difference, so rtol 1e-4.
    Run through prepare_for_lowering and the StepGraph interpreter (no Inductor compile)."""
    model, twin = _model_and_twin()
    for name in ("emb", "bag_sum", "bag_mean"):
        getattr(twin, name).sparse = True
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tables = [twin.emb.weight, twin.bag_sum.weight, twin.bag_mean.weight]
    ref_opts = [torch.optim.SparseAdam(tables, lr=0.01), torch.optim.Adam(twin.head.parameters(), lr=0.01)]
    step = capture_train_step(model, opt, loss_fn, make_batch(0))
    prepared = prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu")
    assert sorted(prepared.meta["recir.embedding"]["sparsify"]["sparsified"]) == sorted(TABLES)
    state = prepared.init_state(model, opt)
    for i in range(STEPS):
        batch = make_batch(i)
        state, _ = prepared(state, batch)
        eager_step(twin, ref_opts, loss_fn, batch)
    got, want = prepared.state_dict(state), eager_state_dict(twin, ref_opts)
    assert {f"optim:{t[len('param:') :]}:exp_avg_sq" for t in TABLES} <= set(want)
    assert state_mismatches(got, want, rtol=1e-4, atol=1e-6) == {}
    # and it is not dense Adam: some row differs from what torch.optim.Adam gives
    dense_model, _ = _model_and_twin()
    dense_opt = torch.optim.Adam(dense_model.parameters(), lr=0.01)
    for i in range(STEPS):
        eager_step(dense_model, dense_opt, loss_fn, make_batch(i))
    assert not torch.allclose(got["param:emb.weight"], dense_model.emb.weight.detach(), atol=1e-4)


class Unsupported(nn.Module):
    """One sparsifiable table and four that must stay dense, each for its own reason."""

    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Embedding(ROWS, D)
        self.freq = nn.Embedding(ROWS, D, scale_grad_by_freq=True)
        self.freq_bag = nn.EmbeddingBag(ROWS, D, mode="sum", scale_grad_by_freq=True)
        self.max_bag = nn.EmbeddingBag(ROWS, D, mode="max")
        self.sparse_bag = nn.EmbeddingBag(ROWS, D, mode="sum", sparse=True)
        self.momentum = nn.Embedding(ROWS, D)
        self.head = nn.Linear(D, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.ok(b["seq"]).sum(1) + self.freq(b["seq"]).sum(1) + self.momentum(b["seq"]).sum(1)
        for bag in (self.freq_bag, self.max_bag, self.sparse_bag):
            x = x + bag(b["ids"], b["offsets"])
        return self.head(x).squeeze(-1)


DENSE_REASONS = {
    "param:freq.weight": ("freq", "scale_grad_by_freq=True"),
    "param:freq_bag.weight": ("freq_bag", "scale_grad_by_freq=True"),
    "param:max_bag.weight": ("max_bag", "mode='max'"),
    "param:sparse_bag.weight": ("sparse_bag", "sparse=True"),
    "param:momentum.weight": ("momentum", "SGD with momentum"),
}


def _unsupported_step():
    torch.manual_seed(0)
    model = Unsupported()
    groups = [
        {"params": [model.momentum.weight], "momentum": 0.9},
        {"params": [p for n, p in model.named_parameters() if not n.startswith("momentum.")]},
    ]
    opt = torch.optim.SGD(groups, lr=0.1)
    return capture_train_step(model, opt, loss_fn, make_batch(0))


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "recir.embedding" and r.levelno == logging.WARNING
    ]


def test_tables_left_dense_are_named_once_each_with_the_reason(caplog):
    step = _unsupported_step()
    with caplog.at_level(logging.WARNING, logger="recir.embedding"):
        prepared = prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu")
    sparsify = prepared.meta["recir.embedding"]["sparsify"]
    assert sparsify["sparsified"] == ["param:ok.weight"]
    assert set(sparsify["dense_tables"]) == set(DENSE_REASONS)  # the head is no table: not listed
    messages = _warnings(caplog)
    assert len(messages) == len(DENSE_REASONS), messages
    for slot, (module, reason) in DENSE_REASONS.items():
        (msg,) = [m for m in messages if f"table {slot} " in m]
        assert f"(module {module!r})" in msg and reason in msg and "O(rows)" in msg, msg
        assert reason in sparsify["dense_tables"][slot]
    # sparse_updates=False is the user's choice: no per-table warning
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recir.embedding"):
        prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu", sparse_updates=False)
    assert not _warnings(caplog)


@pytest.mark.tpu
def test_lower_tpu_compile_warns_once_per_dense_table(caplog):
    lower_tpu = pytest.importorskip("recir.lower_tpu")
    step = _unsupported_step()
    with caplog.at_level(logging.WARNING, logger="recir.embedding"):
        lower_tpu.compile(step)  # prepares the step now, compiles at the first call (not made here)
    messages = _warnings(caplog)
    assert len(messages) == len(DENSE_REASONS), messages
    assert all(any(f"table {slot} " in m for m in messages) for slot in DENSE_REASONS)


class RawParameterLookup(nn.Module):
    """``F.embedding`` on a raw parameter (DLRMv3's position/time embeddings) next to an nn.Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, D)
        self.pos = nn.Parameter(torch.randn(ROWS, D))
        self.head = nn.Linear(D, 1)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.emb(b["seq"]) + nn.functional.embedding(b["seq"], self.pos) + self.pos[b["ids2"]]
        return self.head(x.sum(1)).squeeze(-1)


def test_lookups_of_raw_parameters_stay_dense_without_a_warning(caplog):
    """Only nn.Embedding/nn.EmbeddingBag weights are tables: a raw parameter read by F.embedding or
    indexing keeps its optimizer's dense maths (dense Adam here, as eager torch.optim)."""
    torch.manual_seed(0)
    model = RawParameterLookup()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = capture_train_step(model, opt, loss_fn, make_batch(0))
    with caplog.at_level(logging.WARNING, logger="recir.embedding"):
        prepared = prepare_for_lowering(step, backend="in_graph", target="gpu", device="cpu")
    sparsify = prepared.meta["recir.embedding"]["sparsify"]
    assert sparsify["sparsified"] == ["param:emb.weight"]
    assert "no nn.Embedding/nn.EmbeddingBag weight" in sparsify["skipped"]["param:pos"]
    assert sparsify["tables"] == {"param:emb.weight": "emb"} and not _warnings(caplog)
