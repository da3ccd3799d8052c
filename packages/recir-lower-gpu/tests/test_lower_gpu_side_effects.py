"""compile changes torch's state only while it compiles: a user's own torch.compile in the same process
sees the cache-key pickler, the CPU ISA probe, the C++ sigmoid and bf16 rounding, the cache folder and Inductor's config as they were."""

from __future__ import annotations

import os

import recir.lower_gpu as lg
import torch
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph


def _torch_state() -> tuple:
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.codecache import FxGraphCachePickler
    from torch._inductor.codegen.cpp import CppVecKernel, CppVecOverrides

    return (
        FxGraphCachePickler.__init__,
        CppVecOverrides.__dict__["sigmoid"],
        CppVecKernel.__dict__["get_to_dtype_expr"],
        cpu_vec_isa.VecISA.check_build,
        config.save_config_portable(),
    )


def test_compile_leaves_torch_as_it_was(tmp_path):
    before = _torch_state()
    torch.manual_seed(0)
    model = TinyMLP(din=6, hidden=12)
    step = sgd_step_graph(model, mse_loss, mlp_batch(0, din=6), lr=0.1, momentum=0.0)
    compiled = lg.compile(step, device="cpu", options=lg.GPUOptions(cache_dir=str(tmp_path)))
    compiled(compiled.init_state(model), mlp_batch(0, din=6))
    assert any(tmp_path.iterdir())  # RecIR's compile did use its cache folder
    assert _torch_state() == before
    # torch itself fills TORCHINDUCTOR_CACHE_DIR with its default when a compiled function first runs;
    # RecIR's folder must not be left there
    assert str(tmp_path) not in os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
