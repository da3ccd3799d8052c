"""recir-embed-table-dtype: tables stored fp16/bf16 in a training step (lookups widen gathered rows, float32
updates rounded stochastically), in the dense form and after recir-embed-sparsify-update."""

from __future__ import annotations

import copy

import pytest
import torch
from recir.embedding import (
    TABLE_DTYPE_KEY,
    TABLE_DTYPES,
    ConfigError,
    SparsifyUpdate,
    TableDtype,
    overrides,
    round_stochastic,
)
from recir.embedding._testing import build_step
from recir.embedding._transforms.sparsify_update import TABLE_ELEMENTS_KEY
from recir.transforms import OPTIMIZER_KEY, Pipeline, apply_overrides, get_transform

aten = torch.ops.aten
TABLES = (
    "param:ebc.embedding_bags.t1.weight",
    "param:ebc.embedding_bags.t2.weight",
    "param:ec.embeddings.s1.weight",
)


def _step(helpers, kind):
    tr = helpers.make_torchrec_model()
    model, _ = apply_overrides(copy.deepcopy(tr), overrides())
    gen = torch.Generator().manual_seed(2)
    batches = [helpers.random_batch(gen)[0] for _ in range(4)]
    return model, batches, build_step(model, helpers.loss_fn, batches[0], kind)


def _run(step, model, batches):
    state = step.init_state(model)
    losses = []
    for batch in batches:
        state, (loss,) = step(state, batch)
        losses.append(float(loss))
    return dict(zip(step.signature.state_names(), state)), losses


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of ``t``'s dtype (float16 or bfloat16) at each of its values, as float32."""
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[t.dtype]
    _, exponent = torch.frexp(t.float())  # |t| in [2**(e-1), 2**e)
    smallest = 2.0**-24 if t.dtype == torch.float16 else torch.finfo(torch.bfloat16).tiny * 2.0**-7
    return torch.ldexp(torch.ones_like(t, dtype=torch.float32), exponent - 1 - mantissa).clamp_min(smallest)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["rowwise_adagrad", "adagrad"])  # row-wise = dense (lazy Adam is not)
def test_tables_stored_low_precision_train_like_float32(helpers, dtype, kind):
    assert get_transform("recir-embed-table-dtype") is TableDtype
    model, batches, step = _step(helpers, kind)
    low = Pipeline([TableDtype(dtype=dtype)]).run(step.copy())
    rows = Pipeline([SparsifyUpdate()]).run(low.copy())
    low_dtype = TABLE_DTYPES[dtype]
    slots = {s.name: s for s in low.signature.state}
    assert {t: slots[t].dtype for t in TABLES} == dict.fromkeys(TABLES, low_dtype)
    assert all(s.dtype == torch.float32 for n, s in slots.items() if n.startswith("optim:"))
    assert low.meta[TABLE_DTYPE_KEY] == dict.fromkeys(TABLES, dtype)
    # the row-wise form never widens a whole table: every float32 copy of a table-sized value is gone
    table_shapes = {slots[t].shape for t in TABLES}
    widened = [
        n
        for n in rows.graph.nodes
        if n.target == aten._to_copy.default and tuple(n.meta["val"].shape) in table_shapes
    ]
    assert not widened, widened
    # init_state rounds the model's float32 tables to nearest
    init = dict(zip(low.signature.state_names(), low.init_state(model)))
    for t in TABLES:
        path = t.removeprefix("param:")
        assert torch.equal(init[t], model.get_parameter(path).detach().to(low_dtype))

    want, want_losses = _run(step, model, batches)
    dense, dense_losses = _run(low, model, batches)
    sparse, sparse_losses = _run(rows, model, batches)
    first_dense, _ = _run(low, model, batches[:1])
    first_sparse, _ = _run(rows, model, batches[:1])
    atol = {"fp16": 2e-3, "bf16": 1.5e-2}[dtype]  # four updates at lr 0.1, each rounded to the dtype
    for t in TABLES:
        assert dense[t].dtype == sparse[t].dtype == low_dtype
        assert not torch.equal(dense[t], init[t]), f"{t} never moved"
        torch.testing.assert_close(dense[t].float(), want[t], rtol=0, atol=atol, msg=t)
        # the row-wise form rounds the same float32 values with the same bits: after one step at most one
        # unit apart (where the two forms' float32 sums differ in their last bit), then as close as training
        # from those allows
        one = (first_sparse[t].float() - first_dense[t].float()).abs()
        assert (one <= _ulp(first_dense[t])).all(), t
        torch.testing.assert_close(sparse[t].float(), dense[t].float(), rtol=0, atol=atol / 2, msg=t)
    for name in want:
        if name.startswith("optim:"):
            torch.testing.assert_close(dense[name], want[name], rtol=2e-2, atol=1e-4, msg=name)
            torch.testing.assert_close(sparse[name], dense[name], rtol=2e-2, atol=1e-4, msg=name)
    for a, b, c in zip(want_losses, dense_losses, sparse_losses):
        assert abs(a - b) < 1e-2 * abs(a) + 1e-4 and abs(b - c) < 1e-2 * abs(b) + 1e-4


def test_a_shard_rounds_with_the_whole_tables_bits(helpers):
    """A table's shard (a rank's rows or columns after recir.distributed.distribute) rounds each element with
    the bits that element has in the whole table: ``elements`` gives the shard's first row, first column
    and the table's width, in the dense form (TableDtype) and the row-wise form (sparse_update)."""
    from recir.embedding import sparse_update
    from recir.embedding._rowwise import element_index

    whole = element_index(torch.arange(8), 6)
    assert torch.equal(element_index(torch.arange(4), 3, (4, 2, 6)), whole[4:8, 2:5])
    gen = torch.Generator().manual_seed(0)
    table = (torch.randn(8, 6, generator=gen) * 0.1).half()
    ids = torch.tensor([5, 7, 5, 6])
    grads = torch.randn(4, 6, generator=gen)
    states = {"sum": torch.zeros(8)}
    lr = torch.tensor(0.1)

    def update(param, sts, rows, element=None):
        return sparse_update("rowwise_adagrad", {"eps": 1e-10}, param, sts, lr, None, rows, grads, element)

    full, _ = update(table, states, ids)
    rows_half, _ = update(table[4:].clone(), {"sum": states["sum"][4:].clone()}, ids - 4, (4, 0, 6))
    assert torch.equal(rows_half, full[4:])
    local_only, _ = update(table[4:].clone(), {"sum": states["sum"][4:].clone()}, ids - 4)
    assert not torch.equal(local_only, full[4:])  # without its place the shard draws other bits
    # the dense form takes the same option and leaves it for recir-embed-sparsify-update
    model, batches, step = _step(helpers, "rowwise_adagrad")
    low = Pipeline([TableDtype(dtype="fp16", elements=((TABLES[0], 4, 0, 16),))]).run(step.copy())
    assert low.meta[TABLE_ELEMENTS_KEY] == {TABLES[0]: (4, 0, 16)}


def test_round_stochastic_is_unbiased_and_keeps_updates_below_half_a_unit():
    n = 20_000
    salt = torch.arange(n)
    for dtype in (torch.float16, torch.bfloat16):
        exact = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
        assert torch.equal(round_stochastic(exact.float(), dtype, salt), exact)  # representable: unchanged
        # 1 + a quarter unit: round to nearest never moves, stochastic rounding moves a quarter of the values
        one = torch.ones((), dtype=dtype)
        x = torch.full((n,), 1.0 + 0.25 * float(_ulp(one)))
        assert torch.equal(x.to(dtype), torch.ones(n, dtype=dtype))
        rounded = round_stochastic(x, dtype, salt).float()
        assert set(rounded.unique().tolist()) == {1.0, 1.0 + float(_ulp(one))}
        assert abs(rounded.mean().item() - x[0].item()) < 0.02 * float(_ulp(one))
        # negative values round symmetrically
        assert torch.equal(round_stochastic(-x, dtype, salt).float(), -rounded)
    # fp16's subnormals: multiples of 2**-24, still unbiased
    tiny = torch.full((n,), 3.3e-6)
    rounded = round_stochastic(tiny, torch.float16, salt).float()
    assert rounded.unique().numel() == 2 and abs(rounded.mean().item() / 3.3e-6 - 1) < 0.01
    special = torch.tensor([float("inf"), -float("inf"), 7e4, 0.0, -0.0, 1e-9])
    out = round_stochastic(special, torch.float16, torch.arange(6))
    assert torch.equal(out, special.to(torch.float16))
    assert torch.isnan(round_stochastic(torch.tensor([float("nan")]), torch.bfloat16, torch.arange(1))).all()


def test_checkpoints_cast_into_and_out_of_the_stored_dtype(helpers):
    model, batches, step = _step(helpers, "rowwise_adagrad")
    low = Pipeline([TableDtype(dtype="fp16")]).run(step.copy())
    trained, _ = _run(step, model, batches[:1])
    loaded = dict(zip(low.signature.state_names(), low.load_state_dict(trained)))  # float32 -> fp16
    for t in TABLES:
        assert torch.equal(loaded[t], trained[t].to(torch.float16))
    back = dict(zip(step.signature.state_names(), step.load_state_dict(loaded)))  # fp16 -> float32, exact
    assert all(torch.equal(back[t], loaded[t].float()) for t in TABLES)


def test_bad_inputs(helpers):
    with pytest.raises(ConfigError, match="dtype must be one of"):
        TableDtype(dtype="fp8")
    model, batches, step = _step(helpers, "sgd")
    with pytest.raises(ConfigError, match="are not float32 embedding tables.*Fix"):
        TableDtype(tables=("param:nope",))(step.copy())
    serving = step.copy()
    del serving.meta[OPTIMIZER_KEY]
    with pytest.raises(ConfigError, match="QuantizeTables"):
        TableDtype()(serving)
    only = TableDtype(dtype="bf16", tables=(TABLES[2],))(step.copy())
    assert only.stats["tables"] == [TABLES[2]] and only.stats["bytes_saved"] == 15 * 4 * 2
