"""The docs cannot drift from the code: every shell block of README.md and docs/*.md marked runnable runs
(at the size it shows, on the CPU) and prints what its marker expects; the troubleshooting table quotes
messages the code still raises; links stay inside the repository and resolve; the licence metadata agrees.

A runnable block is a ```bash fence right after `<!-- runnable -->` (optionally `<!-- runnable: expect
"text" expect "more" -->`). `uv run [--no-sync] CMD` in a block runs CMD in this test's environment (its
interpreter's bin folder first on PATH), so the blocks run the same way under nox as in a synced checkout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from _dlrmv3_commands import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"<!-- runnable(?P<marker>[^>]*)-->\s*\n```bash\n(?P<body>.*?)\n```", re.S)
_EXPECT = re.compile(r'expect "([^"]+)"')
# `uv run [--no-sync] CMD` -> CMD in this environment; any other uv command is refused, loudly
_PREAMBLE = """set -euo pipefail
uv() {
  if [ "${1:-}" != run ]; then echo "docs test: only 'uv run' is emulated, got: uv $*" >&2; return 2; fi
  shift
  while [ "${1:-}" = --no-sync ]; do shift; done
  "$@"
}
"""


@dataclass
class Block:
    where: str  # file:line of the fence
    body: str
    expect: list[str]


def runnable_blocks() -> list[Block]:
    """Every runnable block, once per distinct text (the README and the guide share the smoke command)."""
    found: dict[str, Block] = {}
    for doc in DOCS:
        text = doc.read_text()
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start("body"))
            where = f"{doc.relative_to(ROOT)}:{line}"
            block = found.setdefault(m["body"], Block(where, m["body"], []))
            block.expect += [e for e in _EXPECT.findall(m["marker"]) if e not in block.expect]
    return list(found.values())


BLOCKS = runnable_blocks()


def test_the_docs_mark_their_commands_runnable():
    where = [b.where for b in BLOCKS]
    assert any(w.startswith("README.md:") for w in where), where
    assert sum(w.startswith("docs/dlrmv3.md:") for w in where) >= 3, where
    smoke = [b for b in BLOCKS if "recir.examples.dlrmv3.tpu.train" in b.body and "--dry_run" not in b.body]
    assert len(smoke) == 1, "README.md and docs/dlrmv3.md should show the same smoke command"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_runnable_doc_block(block: Block, tmp_path: Path):
    (tmp_path / "deploy").symlink_to(ROOT / "deploy")  # blocks run from the repository root's view
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", _PREAMBLE + block.body], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path, env=env)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{output[-4000:]}"
    assert "Traceback" not in output, output[-4000:]
    for text in block.expect:
        assert text in output, f"{block.where}: expected {text!r} in the output:\n{output[-4000:]}"


def _sources() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "packages").glob("*/src/**/*.py")))


def test_troubleshooting_quotes_messages_the_code_raises():
    text = (ROOT / "docs" / "dlrmv3.md").read_text()
    section = text.split("## Troubleshooting", 1)[1]
    quoted = re.findall(r"^\| `([^`]+)` \|", section, re.M)
    assert len(quoted) >= 10, quoted
    sources = _sources()
    missing = [q for q in quoted if q not in sources]
    assert not missing, f"docs/dlrmv3.md quotes messages no source file contains any more: {missing}"


def _markdown_files() -> list[Path]:
    return [*DOCS, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "packages").glob("*/README.md"))]


def test_links_stay_inside_the_repository_and_resolve():
    problems = []
    for doc in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT):
                problems.append(f"{doc.relative_to(ROOT)}: {target} leaves the repository")
            elif not path.exists():
                problems.append(f"{doc.relative_to(ROOT)}: {target} does not exist")
    assert not problems, problems
    readme = (ROOT / "README.md").read_text()
    for linked in ("docs/dlrmv3.md", "docs/design.md", "CONTRIBUTING.md", "LICENSE"):
        assert f"]({linked})" in readme, f"README.md does not link {linked}"


def test_every_package_states_the_repository_licence():
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License\n")
    for pyproject in [ROOT / "pyproject.toml", *sorted((ROOT / "packages").glob("*/pyproject.toml"))]:
        assert tomllib.loads(pyproject.read_text())["project"]["license"] == "BSD-3-Clause", pyproject
