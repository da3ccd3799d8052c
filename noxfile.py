"""Test matrices for the RecIR workspace: `nox -s cpu tpu transforms_standalone standalone newest oldest lint` is the CI command.

The locked sessions sync the committed lock (`--locked`) into their own virtual environment with uv; `newest`
and `oldest` ignore the lock and resolve the packages' declared ranges at either end.
"""

from __future__ import annotations

import glob
import os
import re
import runpy
import shutil
import subprocess
import tomllib

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["cpu", "tpu", "transforms_standalone", "standalone", "newest", "oldest", "lint"]
nox.options.error_on_missing_interpreters = True

PYTHON = "3.12"  # the lock's default stack; also the first line of .python-version
NEWEST_PYTHON = "3.13"
OLDEST_PYTHON = "3.11"  # requires-python's lower bound
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
# Where Python may not write bytecode caches (PYTHONDONTWRITEBYTECODE, set on the development machines and
# so on CI's) every process compiled torch's, torchrec's and jax's sources again: `import torch, torchrec,
# recir.lower_gpu` took 10.0 s instead of 4.0, in every gloo rank, CLI run and session. uv then writes the
# bytecode once, at install (about 20 s per environment).
if os.environ.get("PYTHONDONTWRITEBYTECODE"):
    os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


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


# The FBGEMM and TorchRec releases built for each torch: one home, recir-embedding's `_versions.py` (standard
# library only, so it runs here without torch).
FBGEMM_FOR_TORCH = runpy.run_path("packages/recir-embedding/src/recir/embedding/_versions.py")[
    "FBGEMM_FOR_TORCH"
]
# TorchRec hard-depends on FBGEMM's CUDA build, which fails to load without CUDA: drop that edge (as the
# root pyproject's override does for the lock); recir-embedding[fbgemm-cpu] brings fbgemm-gpu-cpu instead.
UNLOCKED_OVERRIDES = ["fbgemm-gpu; sys_platform == 'never'"]
# The dev group's test tools (ruff and mypy are lint's).
TEST_REQUIREMENTS = ["pytest>=8.3", "pyyaml>=6"]


def _declared_requirements() -> list[str]:
    """Every workspace package (editable, recir-embedding with its `fbgemm-cpu` extra) plus each package's declared
    third-party requirements as direct ones, so `--resolution lowest-direct` takes every declared lower bound."""
    reqs: list[str] = []
    for pyproject in sorted(glob.glob("packages/*/pyproject.toml")):
        with open(pyproject, "rb") as f:
            project = tomllib.load(f)["project"]
        folder = os.path.dirname(pyproject)
        extra = "[fbgemm-cpu]" if project["name"] == "recir-embedding" else ""
        reqs += ["-e", f"./{folder}{extra}"]
        declared = project["dependencies"] + project.get("optional-dependencies", {}).get("fbgemm-cpu", [])
        reqs += [r for r in declared if not r.startswith("recir-")]
    return reqs + TEST_REQUIREMENTS


def _unlocked_sync(session: nox.Session, resolution: str) -> dict[str, str]:
    """Resolve the declared ranges at one end (`highest` or `lowest-direct`) into the session's environment,
    ignoring the lock and the root's tested-stack constraints (`--no-config`), with FBGEMM and TorchRec
    pinned to the releases built for the resolved torch. Returns the installed versions of the stack."""
    tmp = session.create_tmp()
    requirements = os.path.join(tmp, "requirements.in")
    overrides = os.path.join(tmp, "overrides.txt")
    constraints = os.path.join(tmp, "constraints.txt")
    with open(requirements, "w") as f:
        f.write("\n".join(_declared_requirements()) + "\n")
    with open(overrides, "w") as f:
        f.write("\n".join(UNLOCKED_OVERRIDES) + "\n")
    pins = []
    if resolution == "lowest-direct":
        # Transitive requirements still resolve highest, and the newest tensordict (TorchRec's) needs a newer
        # torch than ours: pin torch to its declared lower bound, or lowest-direct lands on torch 2.11.
        bounds = re.findall(r"^torch>=([\d.]+)", "\n".join(_declared_requirements()), re.MULTILINE)
        pins.append(f"torch=={max(bounds, key=lambda v: tuple(map(int, v.split('.'))))}")
    with open(constraints, "w") as f:
        f.write("".join(f"{pin}\n" for pin in pins))
    python = os.path.join(session.virtualenv.location, "bin", "python")
    common = ["--no-config", "--python", python, "--resolution", resolution, "--overrides", overrides]
    common += ["--constraints", constraints]
    compiled = session.run_install(
        "uv", "pip", "compile", requirements, *common, "--no-header", "--no-annotate", silent=True
    )
    if compiled is not None:  # None: reusing the environment (`nox -R`)
        match = re.search(r"^torch==(\d+\.\d+)", str(compiled), re.MULTILINE)
        if match is None:
            session.error(f"uv pip compile resolved no torch:\n{compiled}")
        fbgemm = FBGEMM_FOR_TORCH.get(match.group(1))
        if fbgemm is None:
            session.error(
                f"resolved torch {match.group(1)}, for which FBGEMM_FOR_TORCH (recir-embedding's _versions.py) names no "
                f"FBGEMM/TorchRec release (known: {', '.join(FBGEMM_FOR_TORCH)}); add the row once FBGEMM "
                "publishes one"
            )
        with open(constraints, "a") as f:
            f.write(f"fbgemm-gpu-cpu=={fbgemm}.*\ntorchrec=={fbgemm}.*\n")
        session.run_install("uv", "pip", "install", "-r", requirements, *common)
    report = session.run(
        "python",
        "-c",
        "import importlib.metadata as m, platform; "
        "print('python', platform.python_version()); "
        "[print(p, m.version(p)) for p in ('torch', 'torchrec', 'fbgemm-gpu-cpu', 'jax', 'torchax')]",
        silent=True,
    )
    if report is None:  # --install-only
        return {}
    versions = dict(line.split(" ", 1) for line in str(report).splitlines() if " " in line)
    session.log("stack: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    return versions


def _smoke(session: nox.Session, name: str) -> None:
    """The `smoke`-marked tests (capture, both lowerings, embeddings, a DLRMv3 train and resume) on the CPU,
    with compile caches of their own."""
    cache = os.path.join(CACHE, name)
    env = {
        **BASE_ENV,
        "JAX_PLATFORMS": "cpu",
        "RECIR_CACHE_DIR": cache,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
    }
    session.run("pytest", "packages", "-m", "smoke and not gpu", *session.posargs, env=env)


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
    """Every package's CPU tests but the `tpu`-marked ones, which the `tpu` session runs (on 8 host devices)."""
    _sync(session)
    env = {**BASE_ENV, "JAX_PLATFORMS": "cpu"}
    session.run("pytest", "packages", "-m", "not gpu and not tpu", *session.posargs, env=env)


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


@nox.session(python=NEWEST_PYTHON)
def newest(session: nox.Session) -> None:
    """The newest releases the packages' metadata accepts (uv's highest resolution, no lock), on Python 3.13.

    torch stops below 2.13 because recir-lower-tpu declares torch < 2.13 (torchax 0.0.13 cannot load on newer
    torch); FBGEMM and TorchRec are the releases built for the resolved torch (FBGEMM_FOR_TORCH)."""
    _unlocked_sync(session, "highest")
    _smoke(session, "newest")


@nox.session(python=OLDEST_PYTHON)
def oldest(session: nox.Session) -> None:
    """The lowest declared bounds (uv's lowest-direct resolution over every declared requirement), on Python 3.11."""
    _unlocked_sync(session, "lowest-direct")
    _smoke(session, "oldest")


# Each library package alone from the lock, with what it must not pull in: TorchRec and FBGEMM are extras,
# JAX and torchax belong to recir-lower-tpu only, and a package imports no sibling it does not list.
STANDALONE = {
    "recir-capture": ("recir.capture", ("jax", "torchax", "torchrec", "fbgemm_gpu", "recir.embedding")),
    "recir-distributed": ("recir.distributed", ("jax", "torchax", "torchrec", "fbgemm_gpu", "recir.capture")),
    "recir-embedding": ("recir.embedding", ("jax", "torchax", "torchrec", "fbgemm_gpu", "recir.capture")),
    "recir-lower-gpu": ("recir.lower_gpu", ("jax", "torchax", "torchrec", "fbgemm_gpu", "recir.capture")),
    "recir-lower-tpu": ("recir.lower_tpu", ("torchrec", "fbgemm_gpu", "recir.capture", "recir.lower_gpu")),
}
# What the tests of a package alone may still use: recir-capture builds their train steps, and
# recir-embedding gives capture's test zoo (recir.capture.testing) its EmbeddingBagOverride and
# RowWiseAdagrad, imported when a test calls them. Both are installed without their dependencies (torch and
# recir-transforms, which every package has), so nothing else comes with them, and only after the `absent`
# check (recir-capture's lists recir.embedding: its library code must not need it); the package under test
# is not installed again as its own sibling. A test whose own code imports anything else absent is skipped
# (conftest.py, RECIR_TESTS_WITHOUT); library code importing it still fails.
STANDALONE_TEST_SIBLINGS = ["packages/recir-capture", "packages/recir-embedding"]
OPTIONAL_MODULES = (
    "jax torchax torchrec fbgemm_gpu tensorboard recir.capture recir.distributed recir.embedding"
)
OPTIONAL_MODULES += " recir.lower_gpu recir.lower_tpu recir.dlrmv3"


@nox.session(python=PYTHON)
@nox.parametrize("package", sorted(STANDALONE))
def standalone(session: nox.Session, package: str) -> None:
    """One library package installed alone (its declared dependencies only): it imports, what it must not need
    is absent, and its `smoke` tests pass (those needing TorchRec, FBGEMM or an undeclared sibling are skipped).

    Only the smoke tests: the whole suite already runs in `cpu` and `tpu`, and running every package's tests a
    second time here took about 22 minutes of a CI run on course for 103 on a 2-core AVX2 machine. `-- -m "not gpu"` runs them
    all."""
    module, absent = STANDALONE[package]
    _sync(session, "--package", package, "--no-default-groups")
    session.run(
        "python",
        "-c",
        "import importlib, importlib.util as u, sys; "
        f"m = importlib.import_module({module!r}); "
        "missing = [n for n in m.__all__ if not hasattr(m, n)]; "
        f"bad = [n for n in {absent!r} if u.find_spec(n)]; "
        f"sys.exit(f'{package} alone: missing public names {{missing}}' if missing else "
        f"f'{package} pulled in {{bad}}' if bad else 0)",
    )
    siblings = [s for s in STANDALONE_TEST_SIBLINGS if os.path.basename(s) != package]
    editable = [arg for s in siblings for arg in ("-e", s)]
    session.run_install("uv", "pip", "install", *TEST_REQUIREMENTS, silent=True)
    if editable:
        session.run_install("uv", "pip", "install", "--no-deps", *editable, silent=True)
    env = {**BASE_ENV, "JAX_PLATFORMS": "cpu", "RECIR_TESTS_WITHOUT": OPTIONAL_MODULES.replace(" ", ",")}
    tests = f"packages/{package}/tests"
    marker = ["-m", "smoke and not gpu"] if not session.posargs else []
    session.run("pytest", tests, *marker, "-p", "no:cacheprovider", *session.posargs, env=env)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy over packages/."""
    _sync(session)
    session.run("ruff", "check", "packages", "noxfile.py", "benchmarks")
    session.run("ruff", "format", "--check", "packages", "noxfile.py", "benchmarks")
    srcs = sorted(glob.glob("packages/*/src"))
    session.run("mypy", *srcs, env={"MYPYPATH": os.pathsep.join(srcs)})
