"""One C++ build per compiled module instead of one per kernel (CPU, inside ``kernels_built_at_end``).

Inductor builds every C++ kernel of a graph as its own shared library: a compiler run that loads the
~120 MB precompiled ``cpp_prefix.h``, compiles one function and links against libtorch. On the 2-core
CPU that fixed cost is most of the work: a DLRMv3 piece's nine kernels took 6.8 s of compiler CPU one by
one and 2.1 s as one translation unit. Here each kernel a module asks for (``AsyncCompile.cpp_pybinding``)
is only recorded; when the module waits for its kernels (``kernels_built_at_end`` defers that wait),
its kernels are built together, in Inductor's worker pool and through its C++ code cache (same flags,
precompiled header and cache folder, keyed by the combined source), as one Python extension with one
function per kernel. Each kernel's ``extern "C" void kernel(...)`` gets its own name from a ``#define``
around its source. Should the combined build fail, each kernel is built alone, as Inductor would.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger("recir.lower_gpu")

_PREFIX = "recir_kernel_"

_GLUE_HEAD = r"""
// Python bindings of the kernels above, one function each (recir.lower_gpu._kernel_batches)
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace recir_batch {
// torch's own accessor of a tensor's data pointer, found through the variable Inductor's loader sets
static void* (*tensor_data)(PyObject*) = nullptr;

template <typename T> inline T arg(PyObject* args, Py_ssize_t i) {
    static_assert(std::is_pointer_v<T>, "a kernel argument is a pointer, an int64_t, a uintptr_t or a float");
    return static_cast<T>(tensor_data(PyTuple_GET_ITEM(args, i)));
}
template <> inline int64_t arg<int64_t>(PyObject* args, Py_ssize_t i) {
    Py_ssize_t v = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, i));
    if (v == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return v;
}
template <> inline uintptr_t arg<uintptr_t>(PyObject* args, Py_ssize_t i) {
    void* v = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, i));
    if (v == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(v);
}
template <> inline float arg<float>(PyObject* args, Py_ssize_t i) {
    double v = PyFloat_AsDouble(PyTuple_GET_ITEM(args, i));
    if (v == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return static_cast<float>(v);
}

template <typename F> inline PyObject* guarded(PyObject* args, Py_ssize_t n, F call) {
    try {
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != n)
            throw std::runtime_error("expected a tuple of " + std::to_string(n) + " arguments");
        call();
        Py_RETURN_NONE;
    } catch (std::exception const& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
    } catch (...) {
        PyErr_SetString(PyExc_RuntimeError, "a kernel raised an unknown C++ exception");
    }
    return nullptr;
}
}  // namespace recir_batch
"""

_GLUE_TAIL = r"""
static struct PyModuleDef recir_batch_module = {PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, recir_batch_methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* addr = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (addr == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }
    recir_batch::tensor_data = reinterpret_cast<void* (*)(PyObject*)>(std::strtoull(addr, nullptr, 10));
    return PyModule_Create(&recir_batch_module);
}
"""


def batched_source(kernels: Sequence[tuple[Sequence[str], str]]) -> str:
    """One translation unit of ``kernels`` ((argtypes, source) as Inductor passes them), kernel ``i`` named
    ``recir_kernel_<i>``, with a Python module ``kernel`` exposing each under that name."""
    parts = [
        f"#define kernel {_PREFIX}{i}\n{source}\n#undef kernel\n" for i, (_, source) in enumerate(kernels)
    ]
    parts.append(_GLUE_HEAD)
    for i, (argtypes, _) in enumerate(kernels):
        args = ", ".join(
            f"recir_batch::arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes)
        )
        parts.append(
            f"static PyObject* {_PREFIX}{i}_py(PyObject*, PyObject* args) {{\n"
            f"    return recir_batch::guarded(args, {len(argtypes)}, [&] {{ {_PREFIX}{i}({args}); }});\n}}\n"
        )
    table = "".join(
        f'    {{"{_PREFIX}{i}", {_PREFIX}{i}_py, METH_VARARGS, ""}},\n' for i in range(len(kernels))
    )
    parts.append(
        f"static PyMethodDef recir_batch_methods[] = {{\n{table}    {{nullptr, nullptr, 0, nullptr}}}};\n"
    )
    parts.append(_GLUE_TAIL)
    return "".join(parts)


class KernelBatch:
    """The kernels one module recorded; ``submit`` starts their combined build."""

    def __init__(self) -> None:
        self.kernels: list[tuple[list[str], str]] = []
        self._lock = threading.Lock()
        self._get: Callable[[], Any] | None = None
        self._module: Any = None
        self._alone: dict[int, Any] = {}

    def add(self, argtypes: Sequence[str], source: str) -> Callable[[], Any]:
        index = len(self.kernels)
        self.kernels.append((list(argtypes), source))
        return lambda: self.function(index)

    def submit(self, submit_fn: Callable[..., Any] | None) -> None:
        """Start the combined build through ``submit_fn`` (Inductor's worker pool; None: built by the first
        kernel asked for, on its thread)."""
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        if not self.kernels or self._get is not None:
            return
        try:
            self._get = CppPythonBindingsCodeCache.load_async(
                batched_source(self.kernels), "cpu", submit_fn=submit_fn
            )
        except Exception as exc:  # noqa: BLE001 - fall back to Inductor's own per-kernel builds
            log.warning(
                "recir.lower_gpu: could not start a batched kernel build (%s); building one by one", exc
            )
            self._get = self._failed

    @staticmethod
    def _failed() -> Any:
        raise RuntimeError("batched build not started")

    def function(self, index: int) -> Any:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        with self._lock:
            if self._get is None:  # never submitted (a module that did not wait): build now
                self.submit(None)
            if self._module is None and index not in self._alone:
                try:
                    self._module = self._get()  # type: ignore[misc]
                except Exception as exc:  # noqa: BLE001 - a kernel the batch cannot hold: each alone
                    log.warning(
                        "recir.lower_gpu: the batched build of %d kernels failed (%s: %s); building each alone",
                        len(self.kernels),
                        type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "",
                    )
                    self._module = False
            if self._module:
                return getattr(self._module, f"{_PREFIX}{index}")
            if index not in self._alone:
                argtypes, source = self.kernels[index]
                self._alone[index] = CppPythonBindingsCodeCache.load_pybinding(argtypes, source)
            return self._alone[index]
