"""Test matrices for the RecIR workspace: `nox -s cpu tpu transforms_standalone lint` is the CI command.

Every session syncs the committed lock (`--locked`) into its own virtual environment with uv.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["cpu", "tpu", "transforms_standalone", "lint"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
# Compile caches shared across sessions and runs (Inductor FX graph cache, JAX compilation cache).
CACHE = os.environ.get("RECIR_CACHE_DIR", os.path.expanduser("~/.cache/recir"))
BASE_ENV = {
    "RECIR_VERIFY": "2",
    "RECIR_CACHE_DIR": CACHE,
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(CACHE, "inductor"),
    # One OpenMP thread per process: the tests spawn gloo ranks and compiler workers on a 2-core machine,
    # and oversubscribed OpenMP threads spin (measured: 10-100x slower eager steps).
    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
}


def _sync(session: nox.Session, *args: str) -> None:
    session.run_install(
        "uv",
        "sync",
        "--locked",
        "--inexact",
        *args,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        silent=True,
    )


def _has_tpu() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _has_cuda() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    result = subprocess.run([smi, "-L"], capture_output=True, text=True, check=False)
    return result.returncode == 0 and "GPU" in result.stdout


@nox.session(python=PYTHON)
def cpu(session: nox.Session) -> None:
    """Every package's CPU tests (the TPU path runs on JAX's CPU backend with one device)."""
    _sync(session)
    env = {**BASE_ENV, "JAX_PLATFORMS": "cpu"}
    session.run("pytest", "packages", "-m", "not gpu", *session.posargs, env=env)


@nox.session(python=PYTHON)
def tpu(session: nox.Session) -> None:
    """The TPU path's tests; on JAX's CPU backend with 8 host devices unless a TPU is present."""
    _sync(session)
    env = dict(BASE_ENV)
    if _has_tpu():
        session.log("TPU found: running the TPU path on it")
    else:
        session.log("no TPU found: running the TPU path on JAX's CPU backend with 8 host devices")
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
    session.run("pytest", "packages", "-m", "tpu", *session.posargs, env=env, success_codes=[0, 5])


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """The CUDA tests; skips (exit 0) with the reason where no CUDA device exists."""
    if not _has_cuda():
        session.skip("no CUDA device on this machine (nvidia-smi missing or lists no GPU): gpu tests skipped")
    _sync(session, "--no-default-groups", "--group", "gpu", "--group", "dev")
    session.run("pytest", "packages", "-m", "gpu", *session.posargs, env=BASE_ENV)


@nox.session(python=PYTHON)
def transforms_standalone(session: nox.Session) -> None:
    """recir-transforms alone: torch is its only dependency, and its tests pass with nothing else."""
    _sync(session, "--package", "recir-transforms", "--no-default-groups")
    session.install("pytest>=8.3")
    session.run(
        "python",
        "-c",
        "import importlib.util as u, sys; "
        "bad = [m for m in ('jax', 'torchax', 'torchrec', 'fbgemm_gpu', 'recir.capture') if u.find_spec(m)]; "
        "sys.exit(f'recir-transforms pulled in {bad}' if bad else 0)",
    )
    session.run("pytest", "packages/recir-transforms/tests", *session.posargs, env=BASE_ENV)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy over packages/."""
    _sync(session)
    session.run("ruff", "check", "packages", "noxfile.py", "benchmarks")
    session.run("ruff", "format", "--check", "packages", "noxfile.py", "benchmarks")
    srcs = sorted(glob.glob("packages/*/src"))
    session.run("mypy", *srcs, env={"MYPYPATH": os.pathsep.join(srcs)})
