"""The CPU SIMD probe's memo: one probe per ISA per machine, also when the background prefetch and the
compile's code generation ask at once; the prefetch starts only while the memo is incomplete."""

from __future__ import annotations

import threading
import time

import pytest
from recir.lower_gpu import _isa


class _FakeISA:
    def __init__(self, flags: str) -> None:
        self._arch_flags = flags


@pytest.fixture
def fake_probe(monkeypatch):
    """VecISA.check_build replaced by a slow counter; valid_vec_isa_list by one that asks it twice."""
    from torch._inductor import cpu_vec_isa

    calls: list[str] = []

    def slow_check(self, code):
        calls.append(self._arch_flags)
        time.sleep(0.3)
        return self._arch_flags != "-mavx512f"

    isas = [_FakeISA("-mavx2"), _FakeISA("-mavx512f")]
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", slow_check)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: [i for i in isas if _probe(i)])
    return calls, isas, slow_check


def _probe(isa) -> bool:
    from torch._inductor import cpu_vec_isa

    return bool(cpu_vec_isa.VecISA.check_build(isa, "int main() {}"))


def test_the_background_probe_and_the_compile_probe_each_isa_once(fake_probe, tmp_path):
    from torch._inductor import cpu_vec_isa

    calls, isas, original = fake_probe
    with _isa.probe_in_background(tmp_path) as thread:
        assert thread is not None
        with _isa.memoized_cpu_isa_probe(tmp_path):  # what code generation does meanwhile
            answers = [_probe(i) for i in isas]
    assert answers == [True, False]
    assert sorted(calls) == ["-mavx2", "-mavx512f"]  # one probe each, not one per thread
    assert cpu_vec_isa.VecISA.check_build is original  # restored once both blocks closed
    memo = _isa._read(_isa.memo_path(tmp_path))
    assert memo[_isa._COMPLETE] is True and sorted(v for k, v in memo.items() if k != _isa._COMPLETE) == [
        False,
        True,
    ]
    with _isa.probe_in_background(tmp_path) as again:  # complete memo: no thread, no probe
        assert again is None
        with _isa.memoized_cpu_isa_probe(tmp_path):
            assert [_probe(i) for i in isas] == [True, False]
    assert len(calls) == 2


def test_a_probe_that_cannot_save_its_answer_is_rerun_by_the_waiting_thread(
    fake_probe, tmp_path, monkeypatch
):
    calls, isas, _ = fake_probe
    monkeypatch.setattr(_isa, "_write", lambda *a: None)  # a read-only cache folder
    results: list[bool] = []
    with _isa.memoized_cpu_isa_probe(tmp_path):
        workers = [threading.Thread(target=lambda: results.append(_probe(isas[0]))) for _ in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=10)
    assert results == [True, True] and calls == ["-mavx2", "-mavx2"]  # answered, never deadlocked


def test_a_probe_list_torch_already_cached_does_not_mark_the_memo_complete(tmp_path, monkeypatch):
    # computed earlier in the process without the memo, torch's cached list probes nothing under it: the
    # memo must stay incomplete, so the next process still probes ahead
    import functools

    from torch._inductor import cpu_vec_isa

    cached = functools.cache(lambda: [])
    cached()
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", cached)
    with _isa.probe_in_background(tmp_path) as thread:
        assert thread is not None
    assert _isa._COMPLETE not in _isa._read(_isa.memo_path(tmp_path))


def test_torch_isa_list_is_built_by_one_thread_at_a_time(fake_probe, tmp_path, monkeypatch):
    # torch's AVX-512 check appends a flag to the shared ISA object for its probe and then puts back what
    # it read: two threads interleaving there leave the flag in for good, so every kernel's compile
    # command (in its cache key) differs from the next process's and the C++ cache misses
    import functools

    from torch._inductor import cpu_vec_isa

    calls, isas, _ = fake_probe
    inside: list[int] = []
    busy = [0]

    @functools.cache
    def like_torch() -> list:
        busy[0] += 1
        inside.append(busy[0])
        found = []
        for isa in isas:
            base = isa._arch_flags
            isa._arch_flags += " -mextra"  # the temporary flag of torch's bf16 check
            ok = _probe(isa)
            isa._arch_flags = base
            if ok:
                found.append(isa)
        busy[0] -= 1
        return found

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", like_torch)
    with _isa.probe_in_background(tmp_path) as thread:
        assert thread is not None
        time.sleep(0.1)  # the background probe is inside torch's list now
        with _isa.memoized_cpu_isa_probe(tmp_path):  # code generation asks meanwhile
            picked = cpu_vec_isa.valid_vec_isa_list()
    assert inside == [1]  # built once, never by two threads at once; the second caller got the first's list
    assert [i._arch_flags for i in isas] == ["-mavx2", "-mavx512f"]  # no flag left behind
    assert picked == isas and sorted(calls) == ["-mavx2 -mextra", "-mavx512f -mextra"]
    assert cpu_vec_isa.valid_vec_isa_list is like_torch  # restored when the last block closed
    assert _isa._read(_isa.memo_path(tmp_path))[_isa._COMPLETE] is True
