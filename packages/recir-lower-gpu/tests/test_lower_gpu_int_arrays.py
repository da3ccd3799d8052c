"""AOTInductor's C++ wrapper (torch 2.10-2.12) caches each size/stride array it declares under the address of
a bound `writeline` made afresh at every call; `package` keys that cache on the buffer written to instead, so
an array is declared in every buffer that names it (a wrapper whose build failed with `'int_array_1' was not
declared` in this package's tests)."""

from __future__ import annotations

import itertools

import pytest
from recir.lower_gpu._export import _int_arrays_keyed_by_buffer


def test_package_declares_each_int_array_in_every_buffer_that_names_it():
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu
    from torch._inductor.utils import IndentedBuffer

    if not hasattr(CppWrapperCpu, "_codegen_int_array_var_impl"):
        pytest.skip("this torch's wrapper has no int-array cache (torch 2.9)")
    before = CppWrapperCpu.__dict__["codegen_int_array_var"]
    wrapper = CppWrapperCpu.__new__(CppWrapperCpu)  # only the int-array state the method reads
    wrapper.codegen_int_array_var_cache = {}
    wrapper.int_array_id = itertools.count()
    wrapper.declared_int_array_vars = set()
    first, second = IndentedBuffer(), IndentedBuffer()
    with _int_arrays_keyed_by_buffer():
        # each call builds its own bound method; the one before is freed, and its address reused
        a = wrapper.codegen_int_array_var("{2, 3}", first.writeline, known_statically=True)
        b = wrapper.codegen_int_array_var("{2, 3}", second.writeline, known_statically=True)
        again = wrapper.codegen_int_array_var("{2, 3}", first.writeline, known_statically=True)
    assert f"{a}[] = {{2, 3}};" in first.getvalue()
    assert f"{b}[] = {{2, 3}};" in second.getvalue(), (a, b, second.getvalue())
    assert again == a and first.getvalue().count("int_array") == 1  # the same buffer reuses its declaration
    assert CppWrapperCpu.__dict__["codegen_int_array_var"] is before  # put back after the block
