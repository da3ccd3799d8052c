"""Lowering errors: ops Inductor can neither generate nor call name the op, the node and the fix.

None of these reach Inductor (the checks run before compiling), so they are fast.
"""

from __future__ import annotations

import pytest
import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph
from recir.transforms import ConfigError, LoweringError, register_override_op


# A recir:: override op whose only kernel is CUDA: on the CPU device it has no runtime implementation.
@torch.library.custom_op("recir::lowergpu_test_cuda_only", mutates_args=(), device_types="cuda")
def _cuda_only(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_cuda_only.register_fake
def _cuda_only_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


register_override_op("recir::lowergpu_test_cuda_only", "recir-lowergpu-test")

# A recir:: op with a fake implementation only (the shape is known, no kernel anywhere).
torch.library.define("recir::lowergpu_test_no_impl", "(Tensor x) -> Tensor")
torch.library.register_fake("recir::lowergpu_test_no_impl")(lambda x: torch.empty_like(x))
register_override_op("recir::lowergpu_test_no_impl", "recir-lowergpu-test")


def _step_with(pre):
    torch.manual_seed(0)

    def loss_fn(model, batch):
        return mse_loss(model, {"x": pre(batch["x"]), "y": batch["y"]})

    return sgd_step_graph(TinyMLP(), loss_fn, mlp_batch(0))


@pytest.mark.parametrize(
    ("pre", "op_name"),
    [
        (torch.ops.recir.lowergpu_test_cuda_only, "recir::lowergpu_test_cuda_only"),
        (torch.ops.recir.lowergpu_test_no_impl, "recir::lowergpu_test_no_impl"),
    ],
)
def test_override_op_without_cpu_kernel_raises_lowering_error(pre, op_name):
    step = _step_with(pre)
    with pytest.raises(LoweringError) as info:
        lg.compile(step, device="cpu")
    msg = str(info.value)
    assert op_name in msg and "has no CPU kernel" in msg
    node = next(n for n in step.graph.nodes if getattr(n.target, "namespace", None) == "recir")
    assert f"%{node.name}" in msg, msg  # the node, shown in a window of the graph
    assert "Fix: register its runtime kernel" in msg and "torch.library.register_kernel" in msg


def test_aten_op_with_only_a_cuda_kernel_raises_lowering_error():
    # aten::_masked_scale has CUDA and Meta kernels only, and Inductor neither lowers nor decomposes it.
    step = _step_with(lambda x: torch.ops.aten._masked_scale(x, torch.ones_like(x, dtype=torch.bool), 2.0))
    with pytest.raises(LoweringError, match=r"op aten::_masked_scale has no CPU kernel") as info:
        lg.compile(step, device="cpu")
    assert "Fix: run on a device with a CPU kernel" in str(info.value)


def test_option_and_device_errors():
    with pytest.raises(ConfigError, match="GPUOptions.mode"):
        lg.GPUOptions(mode="fast")  # type: ignore[arg-type]
    step = _step_with(lambda x: x)
    with pytest.raises(ConfigError, match="ring_shift"):
        lg.compile(step, device="cpu", embedding_backend="ring_shift")
    with pytest.raises(ConfigError, match="not supported; expected cpu or cuda"):
        lg.compile(step, device="meta")
    with pytest.raises(ConfigError, match="expects a StepGraph"):
        lg.compile(step.graph_module)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"torch.cuda.is_available\(\) is False"):
            lg.compile(step, device="cuda")
    with pytest.raises(LoweringError, match="dynamic StepGraphs"):
        lg.compile(step.replace(dynamic=True), device="cpu")


def test_gpu_options_defaults_and_patches():
    opts = lg.GPUOptions()
    assert opts.in_place and opts.cache and opts.mode == "default"
    assert not opts.use_cuda_graphs("cpu") and not opts.use_cuda_graphs("cuda")
    assert lg.GPUOptions(mode="reduce-overhead").use_cuda_graphs("cuda")
    assert not lg.GPUOptions(mode="reduce-overhead").use_cuda_graphs("cpu")
    patches = lg.GPUOptions(mode="max-autotune-no-cudagraphs", inductor_config={"size_asserts": False})
    p = patches.inductor_patches("cuda")
    assert p["max_autotune"] and p["triton.cudagraphs"] is False and p["size_asserts"] is False
    assert lg.GPUOptions(cache=False).inductor_patches("cpu")["fx_graph_cache"] is False
    # Inductor's pre-grad passes (torch-level patterns) are off for ATen StepGraphs, unless the user asks
    from torch._inductor import config as inductor_config

    if hasattr(inductor_config, "use_pre_grad_passes"):
        assert lg.GPUOptions().inductor_patches("cpu")["use_pre_grad_passes"] is False
        asked = lg.GPUOptions(inductor_config={"use_pre_grad_passes": True})
        assert asked.inductor_patches("cpu")["use_pre_grad_passes"] is True


def test_pipelined_steps_keep_their_collective_waits_late():
    # recir-pipeline-sparse's next-batch collectives overlap compute only if Inductor does not pull their
    # waits up next to them: a step with carry: slots sinks waits, an ordinary one keeps Inductor's order
    plain = lg.GPUOptions().inductor_patches("cpu")
    assert "reorder_for_compute_comm_overlap" not in plain
    piped = lg.GPUOptions().inductor_patches("cpu", pipelined=True)
    assert piped["reorder_for_compute_comm_overlap"] is True
    assert piped["reorder_for_compute_comm_overlap_passes"] == ["sink_waits"]
    mine = lg.GPUOptions(inductor_config={"reorder_for_compute_comm_overlap": False})
    assert mine.inductor_patches("cpu", pipelined=True)["reorder_for_compute_comm_overlap"] is False
