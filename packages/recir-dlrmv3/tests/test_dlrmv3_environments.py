"""The three DLRMv3 environments (dependency groups dlrm-cpu, dlrm-gpu, dlrm-tpu of the workspace): the
committed lock resolves each (`uv export --locked` fails on a stale lock), they share one torch and one
jax (the TPU one adds libtpu, the version jax[tpu] asks for), and the pip route's requirement files in
deploy/requirements/ are exactly what the lock exports."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest
from _dlrmv3_commands import ROOT

GROUPS = ("dlrm-cpu", "dlrm-gpu", "dlrm-tpu")
MEMBERS = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^ ;]+)")

pytestmark = pytest.mark.skipif(
    shutil.which("uv") is None, reason="reading the lock needs uv (pip install uv)"
)


def _export(group: str) -> str:
    command = ["uv", "export", "--locked", "--no-default-groups", "--group", group, "--no-hashes",
               "--format", "requirements-txt"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _pins(text: str) -> dict[str, str]:
    found = (_PIN.match(line) for line in text.splitlines())
    return {m.group(1).lower(): m.group(2) for m in found if m}


@pytest.fixture(scope="module")
def exports() -> dict[str, str]:
    return {group: _export(group) for group in GROUPS}


def test_the_lock_resolves_each_environment_with_one_torch_and_one_jax(exports):
    pins = {group: _pins(text) for group, text in exports.items()}
    for group, text in exports.items():
        editable = sorted(
            line.split("/")[-1] for line in text.splitlines() if line.startswith("-e ./packages/")
        )
        assert editable == MEMBERS, (group, editable)
        assert pins[group]["jax"] == pins[group]["jaxlib"], group
    for name in ("torch", "jax", "torchrec", "torchax"):
        assert len({pins[g][name] for g in GROUPS}) == 1, (name, {g: pins[g][name] for g in GROUPS})
    # FBGEMM's CPU build for CPU hosts and TPU VMs, its CUDA build on GPUs; libtpu on the TPU only
    assert "fbgemm-gpu-cpu" in pins["dlrm-cpu"] and "fbgemm-gpu" not in pins["dlrm-cpu"]
    assert "fbgemm-gpu-cpu" in pins["dlrm-tpu"] and "fbgemm-gpu" not in pins["dlrm-tpu"]
    assert "fbgemm-gpu" in pins["dlrm-gpu"] and "fbgemm-gpu-cpu" not in pins["dlrm-gpu"]
    assert (
        "libtpu" in pins["dlrm-tpu"] and "libtpu" not in pins["dlrm-cpu"] and "libtpu" not in pins["dlrm-gpu"]
    )


def test_libtpu_is_the_one_jax_tpu_extra_locks():
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    packages = {p["name"]: p for p in lock["package"]}
    jax = packages["jax"]
    assert {"name": "libtpu"} in jax["optional-dependencies"]["tpu"]  # jax[tpu] of the locked jax
    assert len([p for p in lock["package"] if p["name"] in ("jax", "libtpu")]) == 2  # one of each


def test_pip_requirement_files_match_the_lock(exports):
    def body(text: str) -> list[str]:  # the header names the command that wrote the file
        return [line for line in text.splitlines() if not line.startswith("#    uv export")]

    for group, text in exports.items():
        committed = ROOT / "deploy" / "requirements" / f"{group}.txt"
        assert body(committed.read_text()) == body(text), (
            f"{committed} is stale. Fix: uv export --locked --no-default-groups --group {group} --no-hashes "
            f"-o deploy/requirements/{group}.txt"
        )


def test_the_groups_are_declared_as_documented():
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    assert set(GROUPS) <= set(groups)
    assert any(isinstance(r, str) and r.startswith("jax[tpu]") for r in groups["dlrm-tpu"]), groups[
        "dlrm-tpu"
    ]
