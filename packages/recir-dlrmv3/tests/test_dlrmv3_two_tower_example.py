"""The second-model example (`python -m recir.examples.two_tower.train`): a TorchRec model that is not
DLRMv3 trains, checkpoints and resumes through the libraries alone, in under 60 lines of user code."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch

pytest.importorskip("torchrec")


def _code_lines(source: str) -> int:
    """Lines that are neither blank, comments nor docstrings."""
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines = source.splitlines()
    return sum(
        1
        for i, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#") and i not in docs
    )


def test_two_tower_trains_checkpoints_and_resumes_bit_for_bit(tmp_path, capsys):
    from recir.distributed import load_resharded
    from recir.examples.two_tower import train

    assert _code_lines(inspect.getsource(train)) <= 70
    straight = train.main(
        ["--steps", "12", "--checkpoint_dir", str(tmp_path / "a"), "--checkpoint_every", "4"]
    )
    first = train.main(["--steps", "6", "--checkpoint_dir", str(tmp_path / "b"), "--checkpoint_every", "4"])
    resumed = train.main(
        ["--steps", "12", "--checkpoint_dir", str(tmp_path / "b"), "--checkpoint_every", "4"]
    )
    assert "resumed from" in capsys.readouterr().out
    assert len(straight) == 12 and len(first) == 6 and len(resumed) == 6
    assert first + resumed == straight  # the same losses, bit for bit
    assert straight[-1] != straight[0]
    a, b = load_resharded(tmp_path / "a" / "step-12", None), load_resharded(tmp_path / "b" / "step-12", None)
    assert a.keys() == b.keys() and any(k.startswith("optim:") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_two_tower_auto_buckets_pad_less_and_train_the_same(tmp_path, capsys):
    """``--buckets auto``: powers of two for 8 batches, then learned buckets; the losses equal those of
    one fixed bucket (padding reaches no output), and each run ends with its bucket feedback."""
    from recir.examples.two_tower import train

    def run(*flags: str) -> tuple[list[float], float, int]:
        d = tmp_path / str(len(flags))
        losses = train.main(["--steps", "12", "--checkpoint_dir", str(d), "--checkpoint_every", "12", *flags])
        out = capsys.readouterr().out
        found = re.search(r"padding waste (\d+\.\d)% over 12 batches, (\d+) compiles", out)
        assert found is not None and "suggested buckets: user_id [32]; item_id [32]; history [" in out, out
        return losses, float(found.group(1)), int(found.group(2))

    fixed, fixed_waste, fixed_compiles = run()
    auto, auto_waste, auto_compiles = run("--buckets", "auto")
    assert fixed_compiles == 1 < auto_compiles and auto_waste < fixed_waste / 4, (fixed_waste, auto_waste)
    torch.testing.assert_close(torch.tensor(auto), torch.tensor(fixed), rtol=1e-5, atol=1e-6)


def test_two_tower_bad_buckets_are_a_usage_error(tmp_path, capsys):
    from recir.examples.two_tower import train

    with pytest.raises(SystemExit) as info:
        train.main(["--checkpoint_dir", str(tmp_path), "--buckets", "abc"])
    assert info.value.code == 2 and "argument --buckets: invalid" in capsys.readouterr().err
