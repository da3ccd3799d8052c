"""Quantised tables in FBGEMM's inference-TBE row layout, and the lookup that reads them.

``recir::quantized_lookup`` reads a table packed as FBGEMM's ``IntNBitTableBatchedEmbeddingBagsCodegen``
stores it: one uint8 row per table row, ``[scale fp16, bias fp16, D uint8]`` for int8 (``row ~ q * scale +
bias``) or ``[D fp16]`` for fp16, each row padded to :data:`ROW_ALIGNMENT` bytes. Its implementation is a
pure-ATen reference (what the reference interpreter, Inductor's ``in_graph`` lowering and the TPU path
through torchax run); :func:`lower_quantized_lookups` turns it into FBGEMM's own
``fbgemm::int_nbit_split_embedding_codegen_lookup_function`` in a GraphModule about to be exported, so an
AOTInductor package calls FBGEMM's kernel (and needs ``fbgemm_gpu`` imported to load, RecIR not).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from recir.transforms import ConfigError, embedding_bag_reference, register_override_op
from torch import Tensor

#: FBGEMM's ``SparseType`` codes (``SparseType.as_int()``) of the row formats this module writes
QTYPES: dict[str, int] = {"int8": 2, "fp16": 1}
#: FBGEMM's ``PoolingMode`` codes: sum, mean, and none (one row per id)
POOL_SUM, POOL_MEAN, POOL_NONE = 0, 1, 2
#: bytes each packed row is padded to: what FBGEMM's CUDA kernels read (16-byte loads); its CPU kernel
#: takes the same ``row_alignment``, so one packed table serves both
ROW_ALIGNMENT = 16
#: int8 rows start with the fp16 scale and bias (FBGEMM's ``scale_bias_size_in_bytes`` default)
SCALE_BIAS_BYTES = 4
QUANTIZED_LOOKUP_OVERRIDE = "recir-embed-quantized-lookup"
# FBGEMM's ``EmbeddingLocation`` of weights in ``dev_weights``: DEVICE on CUDA; its CPU kernel refuses
# DEVICE and reads HOST-placed weights from the same argument
_PLACEMENT = {"cuda": 0, "cpu": 3}


def _qtype(code: int) -> str:
    for name, value in QTYPES.items():
        if value == code:
            return name
    raise ConfigError(f"recir::quantized_lookup: qtype {code} is not one of {QTYPES}")


def packed_row_bytes(dim: int, dtype: str) -> int:
    """Bytes per packed row of a ``dim``-wide table stored ``dtype`` (``"int8"``/``"fp16"``), aligned."""
    if dtype not in QTYPES:
        raise ConfigError(f"packed_row_bytes: dtype must be one of {tuple(QTYPES)}, got {dtype!r}")
    raw = dim + SCALE_BIAS_BYTES if dtype == "int8" else 2 * dim
    return -(-raw // ROW_ALIGNMENT) * ROW_ALIGNMENT


def pack_rows(weight: Tensor, dtype: str) -> Tensor:
    """``weight`` ([rows, D], floating) in FBGEMM's inference-TBE layout: uint8 ``[rows, packed_row_bytes]``.

    int8: per row ``scale = (max - min) / 255`` and ``bias = min``, both rounded to fp16 first, then ``q =
    round((x - bias) / scale)`` against those rounded values (a constant row stores scale 0 and exact q 0).
    fp16: the rows rounded to half. Padding bytes are zero."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ConfigError(
            f"pack_rows: expected a floating [rows, D] table, got {weight.dtype}{list(weight.shape)}"
        )
    rows, dim = weight.shape
    w = weight.detach().float()
    out = torch.zeros(rows, packed_row_bytes(dim, dtype), dtype=torch.uint8, device=w.device)
    if dtype == "fp16":
        out[:, : 2 * dim] = w.half().view(torch.uint8)
        return out
    lo = w.amin(dim=1).half()
    scale = ((w.amax(dim=1) - lo.float()) / 255.0).half()
    step = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    q = torch.round((w - lo.float()[:, None]) / step[:, None]).clamp(0, 255).to(torch.uint8)
    out[:, 0:2] = scale.view(torch.uint8).view(rows, 2)
    out[:, 2:4] = lo.view(torch.uint8).view(rows, 2)
    out[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + dim] = q
    return out


def unpack_rows(packed: Tensor, dim: int, dtype: str) -> Tensor:
    """The float32 rows ``[n, dim]`` of packed rows ``[n, packed_row_bytes]`` (plain ATen: traceable)."""
    if dtype == "fp16":
        return packed[:, : 2 * dim].contiguous().view(torch.float16).to(torch.float32)
    params = packed[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16).to(torch.float32)  # [n, 2]
    data = packed[:, SCALE_BIAS_BYTES : SCALE_BIAS_BYTES + dim].to(torch.float32)
    return data * params[:, 0:1] + params[:, 1:2]


def quantized_lookup_reference(
    packed: Tensor,
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    pooling: int,
    dim: int,
    qtype: int,
) -> Tensor:
    """Pure-ATen ``recir::quantized_lookup``: the rows of ``indices`` unpacked, then pooled per bag
    (``offsets``: B+1 entries) by ``pooling`` (0 sum, 1 mean; 2 none: ``[len(indices), dim]``)."""
    flat = indices.reshape(-1)
    rows = unpack_rows(packed.index_select(0, flat), dim, _qtype(qtype))
    if pooling == POOL_NONE:
        return rows
    # the gathered rows pooled as recir::embedding_bag pools a table (as QuantizeTables' aten kernel does)
    positions = torch.arange(flat.shape[0], device=flat.device, dtype=flat.dtype)
    psw = None if per_sample_weights is None else per_sample_weights.reshape(-1)
    return embedding_bag_reference(rows, positions, offsets, psw, pooling)


def _check_args(pooling: int, per_sample_weights: Tensor | None) -> None:
    if pooling not in (POOL_SUM, POOL_MEAN, POOL_NONE):
        raise ValueError(
            f"recir::quantized_lookup: pooling must be 0 (sum), 1 (mean) or 2 (none), got {pooling}"
        )
    if per_sample_weights is not None and pooling != POOL_SUM:
        raise ValueError("recir::quantized_lookup: per_sample_weights needs pooling 0 (sum)")


@torch.library.custom_op("recir::quantized_lookup", mutates_args=())
def quantized_lookup(
    packed: Tensor,
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    pooling: int,
    dim: int,
    qtype: int,
) -> Tensor:
    """Lookup in a table packed by :func:`pack_rows` (FBGEMM's inference-TBE rows), float32 out:
    ``[B, dim]`` pooled over ``offsets`` (B+1 entries) for ``pooling`` 0 (sum) / 1 (mean), or one row per id
    ``[len(indices), dim]`` for 2 (none). ``qtype``: :data:`QTYPES` (2 int8, 1 fp16)."""
    _check_args(pooling, per_sample_weights)
    return quantized_lookup_reference(packed, indices, offsets, per_sample_weights, pooling, dim, qtype)


@quantized_lookup.register_fake
def _quantized_lookup_fake(packed, indices, offsets, per_sample_weights, pooling, dim, qtype):
    rows = indices.numel() if pooling == POOL_NONE else offsets.shape[0] - 1
    return packed.new_empty(rows, dim, dtype=torch.float32)


register_override_op("recir::quantized_lookup", QUANTIZED_LOOKUP_OVERRIDE)
_OP = torch.ops.recir.quantized_lookup.default


def fbgemm_lookup(
    packed: Tensor,
    indices: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    pooling: int,
    dim: int,
    qtype: int,
) -> Tensor:
    """``recir::quantized_lookup`` computed by FBGEMM's inference TBE (one table): what
    :func:`lower_quantized_lookups` puts in an exported graph. Traceable (FBGEMM registers fake kernels)."""
    from ._ops import _fbgemm

    _fbgemm()
    device = packed.device.type
    if device not in _PLACEMENT:
        raise ConfigError(f"FBGEMM's quantised lookup runs on cpu or cuda, not {device!r}")
    ids = indices.reshape(-1).to(torch.int64)
    offs = offsets.to(torch.int64)

    def ints(value: int, dtype: torch.dtype) -> Tensor:
        return torch.full((1,), value, dtype=dtype, device=packed.device)

    return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
        dev_weights=packed.reshape(-1),
        uvm_weights=torch.empty(0, dtype=torch.uint8, device=packed.device),
        weights_placements=ints(_PLACEMENT[device], torch.int32),
        weights_offsets=ints(0, torch.int64),
        weights_tys=ints(qtype, torch.uint8),
        D_offsets=torch.arange(2, dtype=torch.int32, device=packed.device) * dim,
        total_D=dim,
        max_int2_D=0,
        max_int4_D=0,
        max_int8_D=dim if qtype == QTYPES["int8"] else 0,
        max_float16_D=dim if qtype == QTYPES["fp16"] else 0,
        max_float32_D=0,
        indices=ids,
        offsets=offs,
        pooling_mode=pooling,
        indice_weights=None if per_sample_weights is None else per_sample_weights.reshape(-1).float(),
        output_dtype=0,  # SparseType.FP32
        row_alignment=ROW_ALIGNMENT,
    ).view(-1, dim)


def lower_quantized_lookups(gm: fx.GraphModule, device: torch.device | str) -> int:
    """Replace every ``recir::quantized_lookup`` of ``gm`` (a GraphModule about to be exported on
    ``device``) by FBGEMM's inference-TBE op; returns how many. Raises ImportError naming the extra when
    FBGEMM is not installed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from ._ops import _fbgemm

    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _OP]
    if not nodes:
        return 0
    _fbgemm()
    dev = torch.device(device)
    for node in nodes:
        packed, indices, offsets, psw, pooling, dim, qtype = node.args
        tensors = [a for a in (packed, indices, offsets, psw) if isinstance(a, fx.Node)]

        def call(
            *xs: Tensor, _p: bool = psw is not None, _pool: int = pooling, _d: int = dim, _q: int = qtype
        ) -> Tensor:
            return fbgemm_lookup(xs[0], xs[1], xs[2], xs[3] if _p else None, _pool, _d, _q)

        with FakeTensorMode():
            args = [torch.empty(a.meta["val"].shape, dtype=a.meta["val"].dtype, device=dev) for a in tensors]
            sub = make_fx(call)(*args)
        env: dict[fx.Node, fx.Node] = dict(
            zip([p for p in sub.graph.nodes if p.op == "placeholder"], tensors)
        )
        with gm.graph.inserting_before(node):
            for sn in sub.graph.nodes:
                if sn.op == "call_function":
                    env[sn] = gm.graph.node_copy(sn, env.__getitem__)
        node.replace_all_uses_with(env[sub.graph.output_node().args[0]])
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    return len(nodes)
