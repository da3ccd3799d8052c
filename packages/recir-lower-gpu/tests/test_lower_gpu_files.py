"""``write_atomic``, behind the decomposed-graph cache and the CPU ISA probe memo: the exact bytes, an
existing file replaced, the mode a plain open gives, and a write that fails midway leaves the old file and no
temporary file."""

from __future__ import annotations

import os

import pytest
from recir.lower_gpu import _files
from recir.lower_gpu._files import write_atomic


def test_writes_the_exact_bytes_creating_the_folder(tmp_path):
    path = tmp_path / "a" / "b" / "entry.pkl"
    data = bytes(range(256)) * 3
    write_atomic(path, data)
    assert path.read_bytes() == data
    assert sorted(p.name for p in path.parent.iterdir()) == ["entry.pkl"]


def test_an_existing_file_is_replaced(tmp_path):
    path = tmp_path / "memo.json"
    path.write_bytes(b"old, and longer than the new content")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memo.json"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch, step):
    path = tmp_path / "memo.json"
    path.write_bytes(b"old")

    def fail(*args):
        raise OSError(f"{step} failed")

    monkeypatch.setattr(_files.os, step, fail)
    with pytest.raises(OSError, match=f"{step} failed"):
        write_atomic(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memo.json"]  # no .tmp-* left behind


def test_an_interrupt_also_removes_the_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "memo.json"

    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(_files.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, b"new")
    monkeypatch.undo()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_the_file_gets_the_mode_a_plain_open_would(tmp_path, mask):
    """Not mkstemp's 0600: a cache folder shared between users (RECIR_CACHE_DIR) stays readable to them,
    as far as the umask allows."""
    old = os.umask(mask)
    try:
        write_atomic(tmp_path / "memo.json", b"{}")
        (tmp_path / "plain.json").write_bytes(b"{}")
    finally:
        os.umask(old)
    mode = (tmp_path / "memo.json").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain.json").stat().st_mode & 0o777 == 0o666 & ~mask
