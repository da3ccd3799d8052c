"""deploy/: the Dockerfiles install from the lock and default to the smoke command; the GKE JobSets that
deploy/gke/render.py writes are JobSet YAML whose container command lines `recir-dlrmv3 train` (and, on
the GPU job, torchrun) accept. No Docker, no cluster: the files are parsed and the commands dry-run."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from _dlrmv3_commands import ROOT, SMOKE
from _dlrmv3_output import messages
from recir.dlrmv3._cli import _parser, train_main

DOCKER = ROOT / "deploy" / "docker"
GKE = ROOT / "deploy" / "gke"
# Dockerfile -> (dependency group, entry point of its default command)
IMAGES = {"cpu": ("dlrm-cpu", "tpu"), "gpu": ("dlrm-gpu", "gpu"), "tpu": ("dlrm-tpu", "tpu")}


def parse_dockerfile(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments and parser directives dropped, backslash line
    continuations joined, the instruction upper-cased. Raises ValueError on a line that is none."""
    out: list[tuple[str, str]] = []
    pending = ""
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):  # comments inside a continuation are dropped too
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        if not word.isalpha() or word.upper() not in _INSTRUCTIONS:
            raise ValueError(f"line {number}: {word!r} is not a Dockerfile instruction")
        out.append((word.upper(), rest.strip()))
    if pending:
        raise ValueError("the file ends inside a line continuation")
    return out


_INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                 "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}  # fmt: skip


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether Docker leaves `path` (relative to the context) out: the last matching pattern wins, `!`
    re-includes, a pattern matching a folder covers what is under it."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatchcase(p, pat) or fnmatch.fnmatchcase(p, pat.removeprefix("**/")) for p in prefixes
        ) or (pat.startswith("**/") and any(fnmatch.fnmatchcase(x, pat[3:]) for x in parts)):
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.startswith("#")]


def test_dockerfile_parser_refuses_what_is_not_a_dockerfile():
    assert parse_dockerfile("# c\nFROM a\nRUN x \\\n  # c\n  y\n") == [("FROM", "a"), ("RUN", "x y")]
    for bad in ("FROM a\nnot an instruction\n", "FROM a\nRUN x \\\n"):
        with pytest.raises(ValueError):
            parse_dockerfile(bad)


# ids "Dockerfile.gpu", not "gpu": the root conftest skips tests with a `gpu` keyword where no CUDA is
@pytest.mark.parametrize("kind", sorted(IMAGES), ids=lambda kind: f"Dockerfile.{kind}")
def test_dockerfile_installs_from_the_lock_and_runs_the_smoke_command(kind, tmp_path, monkeypatch, capsys):
    group, entry = IMAGES[kind]
    steps = parse_dockerfile((DOCKER / f"Dockerfile.{kind}").read_text())
    names = [name for name, _ in steps]
    assert names[0] == "FROM", names
    base = steps[0][1]
    assert base.startswith("nvidia/cuda:") if kind == "gpu" else base.startswith("python:3.12"), base
    (sync,) = [i for i, (name, args) in enumerate(steps) if name == "RUN" and "uv sync" in args]
    words = shlex.split(steps[sync][1])
    assert {"--locked", "--no-default-groups"} <= set(words), words
    assert words[words.index("--group") + 1] == group and words.count("--group") == 1, words
    groups = tomllib.loads((ROOT / "pyproject.toml").read_text())["dependency-groups"]
    assert group in groups
    if shutil.which("uv"):  # the image's own sync resolves from the committed lock (nothing installed)
        sync_words = words[words.index("uv") :]
        env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "venv")}
        proc = subprocess.run([*sync_words, "--dry-run"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                              env=env)  # fmt: skip
        assert proc.returncode == 0 and "Would install" in proc.stderr + proc.stdout, proc.stderr[-3000:]
        assert not (tmp_path / "venv").exists()
    # the workspace and its lock are in the image before the sync, and the build context keeps them
    copied = [
        shlex.split(args)[:-1] for name, args in steps[:sync] if name == "COPY" and "--from" not in args
    ]
    sources = {s for c in copied for s in c}
    assert {"pyproject.toml", "uv.lock", "packages"} <= sources, sources
    ignore = _dockerignore()
    for source in sources:
        assert (ROOT / source).exists() and not dockerignored(source, ignore), source
    assert not dockerignored("packages/recir-dlrmv3/src/recir/examples/dlrmv3/tpu/train.py", ignore)
    # the default command: the smoke command through the image's entry point, accepted by train
    (cmd,) = [args for name, args in steps if name == "CMD"]
    argv = json.loads(cmd)  # exec form
    assert argv[:3] == ["python", "-m", f"recir.examples.dlrmv3.{entry}.train"], argv
    flags = argv[3:]
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    assert pairs == {**dict(zip(SMOKE[::2], SMOKE[1::2])), "--embedding_backend": "in_graph"}, flags
    monkeypatch.chdir(tmp_path)
    assert train_main(entry, [*flags, "--dry_run"]) == 0
    assert messages(capsys.readouterr().out)[-1].endswith(f"target {entry}; nothing trained")


def test_dockerignore_keeps_the_context_small():
    ignore = _dockerignore()
    for path in (".venv/lib/x.py", ".git/HEAD", ".nox/cpu/bin/python", "runs/a/events", "benchmarks/step.py",
                 "packages/recir-dlrmv3/src/recir/dlrmv3/__pycache__/x.pyc"):  # fmt: skip
        assert dockerignored(path, ignore), path
    for path in ("uv.lock", "pyproject.toml", "packages/recir-transforms/pyproject.toml"):
        assert not dockerignored(path, ignore), path


def _render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recir_deploy_render", GKE / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _render(tmp_path: Path, argv: list[str]) -> dict[str, Any]:
    out = tmp_path / "jobset.yaml"
    assert _render_module().main([*argv[:1], "--out", str(out), *argv[1:]]) == 0
    doc = yaml.safe_load(out.read_text())
    assert isinstance(doc, dict)
    return doc


def _pod(doc: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(the one replicated job, its Job spec, its pod spec) after checking the JobSet's required fields."""
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert doc["metadata"]["name"]
    assert doc["spec"]["network"]["enableDNSHostnames"] is True  # the pods' DNS names below
    (rjob,) = doc["spec"]["replicatedJobs"]
    assert rjob["name"] and rjob["replicas"] == 1
    job = rjob["template"]["spec"]
    assert job["parallelism"] == job["completions"] >= 1 and job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] and all(isinstance(a, str) for a in container["command"])
    declared = {v["name"] for v in pod["volumes"]}
    assert {m["name"] for m in container["volumeMounts"]} <= declared
    return rjob, job, pod


def _mounted(pod: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume that holds `path` in the container."""
    (container,) = pod["containers"]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return volume


def _dry_run(entry: str, flags: list[str], tmp_path: Path, monkeypatch: Any, capsys: Any) -> str:
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert train_main(entry, [*flags, "--dry_run"]) == 0, capsys.readouterr().err
    return messages(capsys.readouterr().out)[-1]


@pytest.mark.parametrize(("nodes", "gpus"), [(2, 8), (4, 1)])
def test_gpu_jobset_runs_torchrun_with_rendezvous_over_the_service(
    nodes, gpus, tmp_path, monkeypatch, capsys
):
    from torch.distributed.run import get_args_parser

    doc = _render(tmp_path, ["gpu", "--image", "registry/recir:gpu", "--checkpoint_bucket", "gs://ckpt-bucket/runs",
                             "--name", "dlrm-a", "--nodes", str(nodes), "--gpus_per_node", str(gpus)])  # fmt: skip
    rjob, job, pod = _pod(doc)
    assert job["parallelism"] == nodes
    (container,) = pod["containers"]
    assert container["image"] == "registry/recir:gpu"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"]
    command = container["command"]
    assert command[0] == "torchrun"
    launch = get_args_parser().parse_args(command[1:])  # torchrun's own parser
    assert (launch.nnodes, launch.nproc_per_node, launch.rdzv_backend) == (str(nodes), str(gpus), "c10d")
    # pod 0 of the job, by the JobSet's hostname scheme <jobset>-<job>-<job index>-<pod index>.<subdomain>
    host, port = launch.rdzv_endpoint.rsplit(":", 1)
    assert host == f"dlrm-a-{rjob['name']}-0-0.dlrm-a"
    assert {"containerPort": int(port), "name": "rendezvous"} in container["ports"]
    assert launch.module and launch.training_script == "recir.examples.dlrmv3.gpu.train"
    flags = launch.training_script_args
    args = _parser(train_target="gpu").parse_args(["train", *flags])
    assert args.parallel == "hybrid" and args.resume == "latest" and args.batch_size % (nodes * gpus) == 0
    volume = _mounted(pod, args.checkpoint_dir)
    assert volume["csi"]["volumeAttributes"]["bucketName"] == "ckpt-bucket" and not volume["csi"]["readOnly"]
    assert args.checkpoint_dir == "/checkpoints/runs/dlrm-a/checkpoints"
    assert _dry_run("gpu", flags, tmp_path, monkeypatch, capsys).endswith("target gpu; nothing trained")


@pytest.mark.parametrize(
    ("topology", "chips_per_host", "hosts"), [("2x2x2", 4, 2), ("4x4", 4, 4), ("2x2", 4, 1)]
)
def test_tpu_jobset_runs_one_jax_process_per_host(
    topology, chips_per_host, hosts, tmp_path, monkeypatch, capsys
):
    doc = _render(tmp_path, ["tpu", "--image", "registry/recir:tpu", "--checkpoint_bucket", "ckpt-bucket",
                             "--data_bucket", "gs://data-bucket/ml-1m", "--dataset", "movielens-1m",
                             "--topology", topology, "--chips_per_host", str(chips_per_host)])  # fmt: skip
    rjob, job, pod = _pod(doc)
    name = doc["metadata"]["name"]
    assert job["parallelism"] == hosts
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == topology
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == chips_per_host
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["JAX_NUM_PROCESSES"] == str(hosts)
    assert env["JAX_COORDINATOR_ADDRESS"].startswith(f"{name}-{rjob['name']}-0-0.{name}:")
    assert env["JAX_PROCESS_ID"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    command = container["command"]
    assert command[:3] == ["python", "-m", "recir.examples.dlrmv3.tpu.train"]
    flags = command[3:]
    args = _parser(train_target="tpu").parse_args(["train", *flags])
    chips = math.prod(int(d) for d in topology.split("x"))
    assert args.multihost and args.mesh == f"data={chips}" and args.batch_size % chips == 0
    assert args.dataset == "movielens-1m" and args.data_dir == "/data/ml-1m"
    assert _mounted(pod, args.data_dir)["csi"]["volumeAttributes"]["bucketName"] == "data-bucket"
    assert _mounted(pod, args.checkpoint_dir)["csi"]["volumeAttributes"]["bucketName"] == "ckpt-bucket"
    # the dry run with the prepared dataset where the job mounts it (here: a local file of the same format)
    data = tmp_path / "ml-1m"
    data.mkdir()
    ids = ",".join(str(i + 1) for i in range(30))
    rows = "".join(f'{u},{u + 1},"{ids}","{",".join("4" * 30)}","{ids}",1,25,3,12345\n' for u in range(8))
    (data / "sasrec_format.csv").write_text(
        "index,user_id,sequence_item_ids,sequence_ratings,sequence_timestamps,sex,age_group,occupation,zip_code\n"
        + rows
    )
    local = [str(data) if a == "/data/ml-1m" else a for a in flags]
    assert _dry_run("tpu", local, tmp_path, monkeypatch, capsys).endswith("target tpu; nothing trained")


@pytest.mark.parametrize(("argv", "says"), [
    (["gpu", "--nodes", "2", "--gpus_per_node", "8", "--batch_size", "20"], "does not split over the job's 16"),
    (["tpu", "--topology", "2x3", "--chips_per_host", "4"], "has 6 chips, not a multiple of --chips_per_host 4"),
    (["tpu", "--topology", "big"], "--topology 'big': expected AxB or AxBxC"),
    (["gpu", "--dataset", "kuairand-1k"], "--dataset kuairand-1k reads files: pass --data_bucket"),
    (["gpu", "--name", "Bad_Name"], "--name 'Bad_Name'"),
])  # fmt: skip
def test_render_refuses_values_the_job_cannot_run(argv, says, tmp_path, capsys):
    base = [
        "--image",
        "registry/recir",
        "--checkpoint_bucket",
        "ckpt-bucket",
        "--out",
        str(tmp_path / "x.yaml"),
    ]
    with pytest.raises(SystemExit) as e:
        _render_module().main([*argv[:1], *base, *argv[1:]])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and says in err, err
    assert not (tmp_path / "x.yaml").exists()


def test_render_passes_flags_after_the_separator_to_train(tmp_path):
    doc = _render(tmp_path, ["gpu", "--image", "i", "--checkpoint_bucket", "ckpt-bucket", "--",
                             "--embedding_dim", "512", "--num_layers", "5"])  # fmt: skip
    command = _pod(doc)[2]["containers"][0]["command"]
    assert command[-4:] == ["--embedding_dim", "512", "--num_layers", "5"] and "--" not in command
