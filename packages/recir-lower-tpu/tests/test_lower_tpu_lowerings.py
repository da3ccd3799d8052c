"""RecIR's JAX lowerings (ops torchax lacks or gets wrong), the registry, and LoweringError."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from recir.lower_tpu import LoweringError, compile, register_jax_lowering, registered_jax_lowerings
from recir.transforms import register_override_op
from torch import nn

pytestmark = pytest.mark.tpu

# XLA CPU float32 vs ATen: reduction order and fusion differ in the last bits; over 5 SGD steps on
# tiny models the drift is ~1e-7, far below the ~1e-2 per-step change a wrong gradient causes.
ATOL, RTOL = 1e-5, 1e-4

IDS = torch.tensor([3, 0, 7, 7, 1, 19, 4, 2, 2, 11])
OFFSETS = torch.tensor([0, 3, 3, 7, 10])  # B+1 offsets with an empty bag (a tie for searchsorted)


class RecirBag(nn.Module):
    """recir::embedding_bag on a table, then a linear head."""

    def __init__(self, mode: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 4))
        self.head = nn.Linear(4, 1)
        self.mode = mode

    def forward(self, ids, offsets, psw=None):
        return self.head(torch.ops.recir.embedding_bag(self.table, ids, offsets, psw, self.mode))


class TorchBag(nn.Module):
    """nn.EmbeddingBag: aten::_embedding_bag and its backward in the graph."""

    def __init__(self, mode: str, padding_idx: int | None = None):
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode=mode, padding_idx=padding_idx)
        self.head = nn.Linear(4, 1)

    def forward(self, ids, offsets, psw=None):
        return self.head(self.bag(ids, offsets, per_sample_weights=psw))


class Block(nn.Module):
    """A pre-norm causal self-attention block: SDPA (fused CPU kernels) and layer norm, both directions."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 1)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(a.transpose(1, 2).reshape(b, n, 8) + x).mean(1)


def _bag_loss(model, b):
    return ((model(b["ids"], b["offsets"], b.get("psw")) - b["y"]) ** 2).mean()


def _torch_bag_loss(model, b):  # nn.EmbeddingBag takes B starts
    return ((model(b["ids"], b["offsets"][:-1], b.get("psw")) - b["y"]) ** 2).mean()


def _block_loss(model, b):
    return ((model(b["x"]) - b["y"]) ** 2).mean()


def _bag_batch(psw: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    batch = {"ids": IDS, "offsets": OFFSETS, "y": torch.randn(4, 1, generator=g)}
    if psw:
        batch["psw"] = torch.rand(10, generator=g)
    return batch


def _check_against_eager_sgd(sgd_step, make_model, loss_fn, batch, steps: int = 5, lr: float = 0.1):
    torch.manual_seed(0)
    model = make_model()
    compiled = compile(sgd_step(model, loss_fn, batch, lr=lr))
    state = compiled.init_state(model)
    torch.manual_seed(0)
    eager = make_model()
    opt = torch.optim.SGD(eager.parameters(), lr=lr)
    for _ in range(steps):
        state, (loss,) = compiled(state, batch)
        opt.zero_grad()
        ref = loss_fn(eager, batch)
        ref.backward()
        opt.step()
        torch.testing.assert_close(loss, ref.detach(), atol=ATOL, rtol=RTOL)
    got = compiled.state_dict(state)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(got[f"param:{name}"], p.detach(), atol=ATOL, rtol=RTOL, msg=name)


@pytest.mark.parametrize(
    ("mode", "psw"), [(0, False), (1, False), (0, True)], ids=["sum", "mean", "weighted"]
)
def test_recir_embedding_bag_trains_like_eager(sgd_step, mode, psw):
    _check_against_eager_sgd(sgd_step, lambda: RecirBag(mode), _bag_loss, _bag_batch(psw))


@pytest.mark.parametrize(
    ("mode", "psw", "padding_idx"),
    [("sum", False, None), ("mean", False, 7), ("max", False, None), ("sum", True, None)],
    ids=["sum", "mean-padding", "max", "weighted"],
)
def test_aten_embedding_bag_is_jittable_with_a_backward(sgd_step, mode, psw, padding_idx):
    # torchax 0.0.13's _embedding_bag loops over concrete offsets (fails under jit) and has no backward.
    _check_against_eager_sgd(sgd_step, lambda: TorchBag(mode, padding_idx), _torch_bag_loss, _bag_batch(psw))


def test_sdpa_and_layer_norm_forward_and_backward(sgd_step):
    # torchax lacks the CPU flash-attention backward and its native_layer_norm_backward calls a
    # jax.lax function that does not exist; both are RecIR lowerings.
    g = torch.Generator().manual_seed(5)
    batch = {"x": torch.randn(3, 5, 8, generator=g), "y": torch.randn(3, 1, generator=g)}
    _check_against_eager_sgd(sgd_step, Block, _block_loss, batch)


def test_searchsorted_honours_right_and_out_int32():
    fn = registered_jax_lowerings()["aten::searchsorted.Tensor"]
    seq, vals = torch.tensor([0, 3, 3, 7]), torch.tensor([3, 4, 0, 7, 9])
    for right in (False, True):
        got = fn(jnp.asarray(seq.numpy()), jnp.asarray(vals.numpy()), right=right, out_int32=True)
        assert got.dtype == jnp.int32
        assert got.tolist() == torch.searchsorted(seq, vals, right=right).tolist()


def test_view_dtype_reinterprets_bytes_as_aten_does():
    """``Tensor.view(dtype)`` to a wider, narrower and same-size dtype: the same bits as torch's."""
    fn = registered_jax_lowerings()["aten::view.dtype"]
    g = torch.Generator().manual_seed(0)
    half = torch.randn(3, 6, generator=g).half()
    raw = half.view(torch.uint8)  # [3, 12]
    for x, dtype in ((raw, torch.float16), (half, torch.uint8), (half, torch.int16), (raw, torch.float32)):
        want = x.view(dtype)
        got = fn(jnp.asarray(x.numpy()), dtype)
        assert tuple(got.shape) == tuple(want.shape) and str(got.dtype) == str(want.dtype).removeprefix(
            "torch."
        )
        assert got.tobytes() == want.numpy().tobytes(), (x.dtype, dtype)


def test_builtin_lowerings_are_listed():
    names = set(registered_jax_lowerings())
    for op in (
        "recir::embedding_bag",
        "aten::_embedding_bag",
        "aten::_embedding_bag_backward",
        "aten::native_layer_norm_backward",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
        "aten::_native_batch_norm_legit_functional",
    ):
        assert op in names, op


# -- custom recir ops: a registered lowering, the ATen-reference fallback, and no lowering at all --------
@torch.library.custom_op("recir::lower_tpu_test_twice", mutates_args=())
def lower_tpu_test_twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@lower_tpu_test_twice.register_fake
def _twice_fake(x):
    return torch.empty_like(x)


def lower_tpu_test_twice_reference(x: torch.Tensor) -> torch.Tensor:
    """The pure-ATen reference, found by convention (``<op name>_reference`` next to the op)."""
    return x + x


@torch.library.custom_op("recir::lower_tpu_test_opaque", mutates_args=())
def lower_tpu_test_opaque(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@lower_tpu_test_opaque.register_fake
def _opaque_fake(x):
    return torch.empty_like(x)


register_override_op("recir::lower_tpu_test_twice", "recir-lower-tpu-test")
register_override_op("recir::lower_tpu_test_opaque", "recir-lower-tpu-test")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))


def _loss_through(op):
    def loss_fn(model, b):
        return ((model(op(b["x"])) - b["y"]) ** 2).mean()

    return loss_fn


_BATCH = {"x": torch.randn(2, 3), "y": torch.randn(2, 1)}


def test_recir_op_falls_back_to_its_aten_reference(sgd_step):
    _check_against_eager_sgd(sgd_step, _mlp, _loss_through(torch.ops.recir.lower_tpu_test_twice), _BATCH)


def test_registered_jax_lowering_wins_over_the_reference(sgd_step):
    calls = []

    def twice(x):
        calls.append(x.shape)
        return x * 2

    register_jax_lowering("recir::lower_tpu_test_twice", twice)
    try:
        _check_against_eager_sgd(sgd_step, _mlp, _loss_through(torch.ops.recir.lower_tpu_test_twice), _BATCH)
    finally:
        from recir.lower_tpu import _registry

        _registry._LOWERINGS.pop("recir::lower_tpu_test_twice")
    assert calls == [(2, 3)], "the JAX lowering runs once, at trace time"


def test_recir_op_without_lowering_names_op_node_and_fix(sgd_step):
    step = sgd_step(_mlp(), _loss_through(torch.ops.recir.lower_tpu_test_opaque), _BATCH)
    with pytest.raises(LoweringError) as info:
        compile(step)
    msg = str(info.value)
    assert "recir::lower_tpu_test_opaque" in msg and "%lower_tpu_test_opaque" in msg
    assert "--> %lower_tpu_test_opaque = recir.lower_tpu_test_opaque(" in msg  # the graph window
    assert "register_jax_lowering('recir::lower_tpu_test_opaque'" in msg
    assert info.value.op == "recir::lower_tpu_test_opaque"


def test_aten_op_without_lowering_raises_at_first_call(sgd_step):
    def loss_fn(model, b):
        pooled = torch.segment_reduce(b["x"], "sum", lengths=b["lengths"])  # torchax has no lowering
        return ((model(pooled) - b["y"]) ** 2).mean()

    batch = {"x": torch.randn(4, 3), "lengths": torch.tensor([1, 3]), "y": torch.randn(2, 1)}
    model = _mlp()
    compiled = compile(sgd_step(model, loss_fn, batch))
    with pytest.raises(
        LoweringError, match=r"aten::segment_reduce at node %segment_reduce has no lowering"
    ) as info:
        compiled(compiled.init_state(model), batch)
    assert "Environment.override_op_definition" in str(info.value)


def test_lower_tpu_low_precision_matmuls_accumulate_in_fp32():
    import numpy as np
    from recir.lower_tpu._lowerings import aten_addmm, aten_mm

    assert {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm"} <= set(registered_jax_lowerings())
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 4096, generator=g), torch.randn(4096, 16, generator=g)
    bias = torch.randn(16, generator=g)

    def bf16(t):
        return jnp.asarray(t.numpy()).astype(jnp.bfloat16)

    def back(x):
        return torch.from_numpy(np.asarray(x.astype(jnp.float32)))

    exact = a.bfloat16().double() @ b.bfloat16().double()
    out = aten_mm(bf16(a), bf16(b))
    assert out.dtype == jnp.bfloat16  # torch's semantics: the operands' dtype
    # one rounding of the fp32 sum to bf16 (8-bit mantissa): within 2**-8 of the exact product
    assert ((back(out).double() - exact).abs() / exact.abs().clamp(min=1.0)).max() < 2**-8
    got = back(aten_addmm(bf16(bias), bf16(a), bf16(b), beta=0.5, alpha=2.0)).double()
    want = 2.0 * exact + 0.5 * bias.bfloat16().double()
    assert ((got - want).abs() / want.abs().clamp(min=1.0)).max() < 2**-7
    nan_bias = jnp.full((16,), jnp.nan, jnp.float32)
    assert not np.isnan(np.asarray(aten_addmm(nan_bias, a.numpy(), b.numpy(), beta=0))).any()
    # fp32 operands: a plain fp32 product (at full precision: a TPU's default is one bfloat16 pass)
    with jax.default_matmul_precision("highest"):
        fp32 = aten_mm(a.numpy(), b.numpy())
    torch.testing.assert_close(back(fp32), a @ b, rtol=1e-4, atol=1e-3)


def _dot_operand_dtypes(hlo: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot in an optimised HLO module's text."""
    import re

    types = dict(re.findall(r"(%[\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r"= \w+\[[\d,]*\]\S* dot\((%[\w.\-]+), (%[\w.\-]+)\)", hlo)
    return [(types[a], types[b]) for a, b in dots]


def test_lower_tpu_bf16_products_with_transposed_operands_stay_bf16_on_xla_cpu(sgd_step):
    """recir-mixed-precision's backward products read transposes (`dY @ W`, `X^T @ dY`) and a linear's
    forward reads `W^T`. XLA:CPU upcasts a bf16 product whose operand keeps a transposed layout to fp32
    (its fast bf16 kernels take row-major operands), so these lowerings keep bf16 transposes row-major:
    every product of the compiled step reads bf16, and training matches the fp32 step within bf16 noise."""
    import jax
    from recir.transforms import MixedPrecision, Pipeline

    if jax.default_backend() != "cpu":
        pytest.skip("checks XLA:CPU's product selection")
    batch = {"x": torch.randn(64, 32, generator=torch.Generator().manual_seed(1)), "y": torch.randn(64, 8)}

    def make():  # no 1-wide product: XLA runs matrix-vector products its own way
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 8))

    def loss_fn(model, b):
        return ((model(b["x"]) - b["y"]) ** 2).mean()

    step = Pipeline([MixedPrecision()]).run(sgd_step(make(), loss_fn, batch))
    compiled = compile(step)
    dots = _dot_operand_dtypes(compiled.lower().compile().as_text())
    assert len(dots) == 8, dots  # 3 forward, 2 + 3 backward (the input needs no gradient)
    assert all(d == ("bf16", "bf16") for d in dots), dots
    state = compiled.init_state(make())
    reference = compile(sgd_step(make(), loss_fn, batch))
    ref_state = reference.init_state(make())
    for _ in range(3):
        state, (loss,) = compiled(state, batch)
        ref_state, (ref_loss,) = reference(ref_state, batch)
        torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=2e-2)
    got, want = compiled.state_dict(state), reference.state_dict(ref_state)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.parametrize(
    "key,base,n", [(7, 0, 1), (2**32 - 7, 2**31 - 1000, 5003), (2**40 + 99, 2**32 + 5, 4096)]
)
def test_counter_uniform_lowers_to_uint32_bit_for_bit(key, base, n):
    """recir::counter_uniform (recir-capture's random numbers) in uint32 maths equals its int64
    reference bit for bit, and no [n]-sized value of the lowering is 64-bit (what a TPU emulates)."""
    import numpy as np
    from recir.capture._rng import counter_uniform_reference
    from recir.lower_tpu._lowerings import recir_counter_uniform

    with jax.enable_x64(True):
        k = jnp.asarray(key, dtype=jnp.int64)
        got = np.asarray(jax.jit(recir_counter_uniform, static_argnums=(1, 2))(k, base, n))
        jaxpr = jax.make_jaxpr(recir_counter_uniform, static_argnums=(1, 2))(k, base, n)
    want = counter_uniform_reference(torch.tensor(key), base, n).numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want)
    # the numbers leave through a barrier, so XLA on a TPU computes them once (see the next test)
    assert jaxpr.eqns[-1].primitive.name == "optimization_barrier", jaxpr.eqns[-1]
    assert jaxpr.jaxpr.outvars == jaxpr.eqns[-1].outvars
    wide = [
        str(v.aval)
        for e in jaxpr.eqns
        for v in e.outvars
        if v.aval.shape == (n,) and v.aval.dtype.itemsize == 8
    ]
    assert not wide, wide


def test_counter_hash_is_computed_once_per_random_op_on_a_tpu():
    """On a TPU, each recir::counter_uniform's hash is one fusion of its own in the optimised program: XLA
    does not copy it into its consumers' fusions (a dropout's product forward, the products of its
    backward), where it made the TPU compiler's large product fusions slow to schedule (see the lowering).
    XLA:CPU expands optimization barriers before fusion, so this needs a TPU."""
    import re

    from recir.capture import capture_train_step
    from recir.lower_tpu._lowerings import _MUL

    if jax.default_backend() != "tpu":
        pytest.skip("XLA:CPU expands optimization barriers before fusion; the fusion check needs a TPU")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.25), nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(256, 8),
    )  # fmt: skip
    batch = {"x": torch.randn(256, 32), "y": torch.randn(256, 8)}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = capture_train_step(model, opt, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), batch)
    random_ops = [n for n in step.graph.nodes if n.target == torch.ops.recir.counter_uniform.default]
    assert len(random_ops) == 2, [n.target for n in step.graph.nodes]
    hlo = compile(step).lower().compile().as_text()
    # the hash's vector multiply by its constant: once per computation that holds it
    vector_multiply = re.compile(r"u32\[\d[\d,]*\][^\n]* multiply\(")
    computations = re.split(r"\n(?=\S)", hlo)
    hashing = [
        c.split("(")[0] for c in computations if vector_multiply.search(c) and f"constant({_MUL})" in c
    ]
    assert len(hashing) == len(random_ops), hashing
