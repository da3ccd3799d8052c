"""The README's example runs as written (so the documentation cannot rot)."""

import re
from pathlib import Path


def test_transforms_readme_example_runs(capsys):
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README.md has no python example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "recir-cleanup-cse  changed" in out and "merged=2" in out
    assert namespace["forward_only"].signature.outputs[0].name == "loss"  # type: ignore[attr-defined]
