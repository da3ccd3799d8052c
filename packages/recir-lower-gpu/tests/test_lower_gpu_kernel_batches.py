"""One C++ build per compiled module (recir.lower_gpu._kernel_batches): the kernels a module asks for are
built as one library, and a set that cannot share one is built kernel by kernel."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import recir.lower_gpu as lg
import torch
from recir.lower_gpu._cache import using_cache_dir
from recir.lower_gpu._kernel_batches import KernelBatch, batched_source
from test_lower_gpu_regions import _batch, _step
from torch._inductor.codecache import CppPythonBindingsCodeCache


def _kernel(body: str, helper: str = "") -> str:
    """A kernel in the form Inductor writes one: its prefix header, then ``extern "C" void kernel``."""
    return (
        "#include <torch/csrc/inductor/cpp_prefix.h>\n"
        f"{helper}\n"
        'extern "C" void kernel(const float* in_ptr0, float* out_ptr0, const int64_t ks0) {\n'
        f"    for (int64_t i = 0; i < ks0; ++i) {{ out_ptr0[i] = {body}; }}\n"
        "}\n"
    )


_SOURCE = re.compile(r"cpp_pybinding\(\[.*?\], r?'''(.*?)'''\)", re.S)  # a kernel in Inductor's module code
_ARGTYPES = ["const float*", "float*", "const int64_t"]


def _libraries(folder: Path, marker: str) -> list[str]:
    """The sources of the libraries built in ``folder`` that contain ``marker`` (not Inductor's ISA probes)."""
    sources = (so.with_suffix(".cpp") for so in folder.rglob("*.so"))
    return [text for text in (p.read_text() for p in sources if p.exists()) if marker in text]


def _run(fn, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    fn(x, out, x.numel())
    return out


def test_a_batch_builds_its_kernels_as_one_library(tmp_path):
    x = torch.arange(8, dtype=torch.float32)
    kernels = [(_ARGTYPES, _kernel("in_ptr0[i] + 17.0f")), (_ARGTYPES, _kernel("in_ptr0[i] * 3.0f - 5.0f"))]
    assert "recir_kernel_1(" in batched_source(kernels) and "PyInit_kernel" in batched_source(kernels)
    with using_cache_dir(tmp_path):
        batch = KernelBatch()
        futures = [batch.add(*k) for k in kernels]
        batch.submit(None)
        add, affine = (f() for f in futures)
    torch.testing.assert_close(_run(add, x), x + 17.0, rtol=0, atol=0)
    torch.testing.assert_close(_run(affine, x), x * 3.0 - 5.0, rtol=0, atol=0)
    (library,) = _libraries(tmp_path, "in_ptr0[i] + 17.0f")  # both kernels, one compiler run
    assert "in_ptr0[i] * 3.0f - 5.0f" in library


def test_kernels_that_cannot_share_a_library_are_built_one_by_one(tmp_path, caplog):
    x = torch.arange(8, dtype=torch.float32)
    helper = "static float recir_test_twice(float v) { return 2.0f * v; }"  # defined twice once combined
    kernels = [
        (_ARGTYPES, _kernel("recir_test_twice(in_ptr0[i]) + 1.0f", helper)),
        (_ARGTYPES, _kernel("recir_test_twice(in_ptr0[i]) - 1.0f", helper)),
    ]
    with using_cache_dir(tmp_path), caplog.at_level(logging.WARNING, logger="recir.lower_gpu"):
        batch = KernelBatch()
        futures = [batch.add(*k) for k in kernels]
        batch.submit(None)
        first, second = (f() for f in futures)
    assert "building each alone" in caplog.text
    torch.testing.assert_close(_run(first, x), 2 * x + 1.0, rtol=0, atol=0)
    torch.testing.assert_close(_run(second, x), 2 * x - 1.0, rtol=0, atol=0)
    assert len(_libraries(tmp_path, "recir_test_twice")) == 2 and not _libraries(tmp_path, "recir_batch")


@pytest.mark.parametrize("regions", ["whole", "repeated"])
def test_a_compile_builds_one_library_per_module_and_trains_as_kernel_by_kernel(tmp_path, regions):
    """Each compiled module's kernels come from one library (fewer libraries than kernels), and the step
    trains bit for bit as with a library per kernel (GPUOptions.batch_cpu_kernels=False)."""
    runs = {}
    for batch in (True, False):
        folder = tmp_path / str(batch)
        # Inductor keeps each library it loaded in memory, keyed by source: earlier tests' compiles of this
        # model would otherwise be reused without writing anything into this folder
        CppPythonBindingsCodeCache.cache_clear()
        model, opt, step = _step()
        options = lg.GPUOptions(regions=regions, batch_cpu_kernels=batch, cache_dir=str(folder))
        compiled = lg.compile(step, device="cpu", options=options)
        modules = [p for p in folder.rglob("*.py") if "cpp_pybinding(" in p.read_text()]
        sources = [src for p in modules for src in _SOURCE.findall(p.read_text())]
        kernels = len(sources)
        batched, alone = _libraries(folder, "recir_batch"), _libraries(folder, 'extern "C"')
        if batch:
            assert len(batched) == len(alone) == len(modules) < kernels, (len(batched), len(modules), kernels)
            assert sum(lib.count("#define kernel recir_kernel_") for lib in batched) == kernels
        else:
            assert not batched and len(modules) < len(alone) <= len(set(sources))  # a library per kernel
        state = compiled.init_state(model, opt)
        for i in range(1, 4):
            state, _ = compiled(state, _batch(i))
        runs[batch] = compiled.state_dict(state)
    for name, value in runs[False].items():
        torch.testing.assert_close(runs[True][name], value, rtol=0, atol=0, msg=name)
