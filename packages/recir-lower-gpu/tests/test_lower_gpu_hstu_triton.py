"""``GPUOptions(hstu_attention="triton")``: RecIR's fused Triton kernels for ``recir::hstu_attention`` and its
backward (recir.lower_gpu._hstu_triton).

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, in a fresh process:
``_hstu_triton_check.py``) and are compared with the ATen references: values and (dq, dk, dv), float32 (products in IEEE
precision) and float16 (float32 accumulation), with padded history slots, padded candidates, a head dim
that is not a power of two and sequences that are not a multiple of the block. The interpreter cannot
take bf16 products (its ``tl.dot`` reads bf16 as another type), so bf16 waits for a GPU. The pipeline
retargets both ops, refuses a CPU device with a fix, and on CUDA (``gpu`` marker) a compiled step
matches eager torch.optim."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import recir.lower_gpu as lg
import torch
from recir.capture import capture_train_step, testing
from recir.transforms import (
    ConfigError,
    hstu_attention,
    verify,
)
from torch import nn

triton = pytest.importorskip("triton")


def test_kernels_equal_the_references_in_tritons_interpreter():
    """The checks of ``_hstu_triton_check.py``, run in a fresh process with ``TRITON_INTERPRET=1`` (Triton
    decides at definition whether a kernel is interpreted, and this process may hold them compiled)."""
    script = Path(__file__).with_name("_hstu_triton_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("ok ") == 4, done.stdout


class _Attention(nn.Module):
    """q, k, v projections and recir::hstu_attention over 24 slots (the last 6 candidates)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 3 * 2 * 16), nn.Linear(2 * 16, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x, valid = batch["x"], batch["valid"]
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, 2, 16).permute(2, 0, 3, 1, 4)
        attn = hstu_attention(q, k, v, valid, torch.tensor(float(N), device=x.device), 18, 0.25, [0, N])
        return self.out(attn.transpose(1, 2).reshape(B, N, -1)).sum()


def _batch(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    valid = torch.arange(24)[None, :] < torch.tensor([[20], [24], [12]])
    return {"x": torch.randn(3, 24, 8, generator=g).to(device), "valid": valid.to(device)}


def _loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(batch)


def _step(device: str = "cpu"):
    torch.manual_seed(0)
    model = _Attention().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer, capture_train_step(model, optimizer, _loss, _batch(0, device))


def test_triton_attention_retargets_both_ops():
    from recir.lower_gpu._hstu_triton import TritonAttention

    _, _, step = _step()
    before = [n.target for n in step.graph.nodes if n.op == "call_function"]
    assert torch.ops.recir.hstu_attention.default in before
    assert torch.ops.recir.hstu_attention_backward.default in before
    result = TritonAttention()(step)
    assert result.changed and result.stats["retargeted"] == 2
    after = {n.target for n in result.step.graph.nodes if n.op == "call_function"}
    assert torch.ops.recir.hstu_attention_triton.default in after
    assert torch.ops.recir.hstu_attention_backward_triton.default in after
    assert torch.ops.recir.hstu_attention.default not in after
    verify(result.step, level=2)  # INV-6 accepts the Triton ops as the attention override's


def test_triton_attention_on_the_cpu_device_is_refused_with_a_fix(tmp_path):
    _, _, step = _step()
    with pytest.raises(ConfigError, match=r"hstu_attention='triton'.*CUDA.*Fix: hstu_attention='inductor'"):
        lg.compile(
            step, device="cpu", options=lg.GPUOptions(hstu_attention="triton", cache_dir=str(tmp_path))
        )


def test_bad_hstu_attention_names_the_choices():
    with pytest.raises(ConfigError, match=r"hstu_attention.*'inductor' or 'triton'.*flash"):
        lg.GPUOptions(hstu_attention="flash")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "kernel"),
    [("cpu", "inductor"), pytest.param("cuda", "triton", marks=pytest.mark.gpu)],
    ids=["cpu-inductor", "cuda-triton"],
)
def test_compiled_attention_step_matches_eager_adam(device, kernel, lower_gpu_cache_dir):
    """5 compiled steps of a model around ``recir::hstu_attention`` against eager torch.optim.Adam: the loss
    at each step, then every parameter and both moments. On CUDA the attention runs as the Triton kernels;
    on the CPU, as Inductor's kernels from the op's reference (the same test, so the CUDA case's harness is
    exercised where CI runs)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device; none is present (torch.cuda.is_available() is False)")
    model, optimizer, step = _step(device)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    options = lg.GPUOptions(hstu_attention=kernel, cache_dir=lower_gpu_cache_dir)  # type: ignore[arg-type]
    compiled = lg.compile(step, device=device, options=options)
    ops = {n.target._schema.name for n in compiled.step.graph.nodes if hasattr(n.target, "_schema")}
    assert ("recir::hstu_attention_triton" in ops) == (kernel == "triton"), sorted(ops)
    state = compiled.init_state(model, optimizer)
    for i in range(5):
        batch = _batch(i, device)
        state, outputs = compiled(state, batch)
        torch.testing.assert_close(
            outputs[0], testing.eager_step(ref, ref_opt, _loss, batch), rtol=1e-4, atol=1e-5
        )
    eager = testing.eager_state_dict(ref, ref_opt)
    moments = [name for name in eager if "exp_avg" in name]
    assert len(moments) == 2 * len(list(ref.parameters())), sorted(eager)
    bad = testing.state_mismatches(compiled.state_dict(state), eager, rtol=1e-4, atol=1e-5)
    assert not bad, bad
    assert set(eager) <= set(compiled.state_dict(state)), sorted(set(eager) - set(compiled.state_dict(state)))


@pytest.mark.parametrize("arch", [80, 90], ids=["sm80", "sm90"])
@pytest.mark.parametrize(
    ("dtype", "ptr"), [(torch.float32, "*fp32"), (torch.bfloat16, "*bf16")], ids=["fp32", "bf16"]
)
def test_kernels_compile_for_cuda_without_a_gpu(arch, dtype, ptr, tmp_path, monkeypatch):
    """Each kernel through Triton's whole compiler (to PTX and, with Triton's own ptxas, a cubin) for an
    A100 (sm_80) and an H100/H200 (sm_90) at full-size DLRMv3's attention shape (head dim 128, UIH 1024
    and 10 candidates), in bf16 and in float32: what the interpreter cannot check (bf16 products, the
    compiled control flow), and every kernel's shared memory within the 99 KiB per block of the smallest
    CUDA GPUs Triton targets (Ampere and Ada consumer parts; 48-72 KiB measured)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not read from a cache
    from recir.lower_gpu import _hstu_triton_kernels as kernels
    from recir.lower_gpu._hstu_triton import kernel_constants
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    shape = dict(H=4, N=1036, prefix=1026, A=128)
    consts = {**kernel_constants(dtype, shape["A"]), **shape}
    pointers = {"forward": 4, "backward_q": 5, "backward_kv": 6}
    for name, n_pointers in pointers.items():
        fn = getattr(kernels, name)
        signature = {a: ptr for a in fn.arg_names[:n_pointers]}
        signature.update(S=ptr, s_stride="i32", L="*i32", alpha="fp32", **{c: "constexpr" for c in consts})
        source = ASTSource(
            fn=fn, signature=signature, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()}
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
        assert compiled.asm["cubin"], name
        assert compiled.metadata.shared <= 99 * 1024, (name, compiled.metadata.shared)
