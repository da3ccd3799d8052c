"""Renders the GKE JobSet templates beside this file (jobset-gpu.yaml, jobset-tpu.yaml) with the few
values a user sets: image, nodes and accelerators per node (GPU) or TPU type and topology, data and
checkpoint buckets. Standard library only; prints the JobSet (or writes --out) for `kubectl apply -f`.

    python deploy/gke/render.py gpu --image IMAGE --checkpoint_bucket BUCKET[/PATH] --nodes 2 --gpus_per_node 8
    python deploy/gke/render.py tpu --image IMAGE --checkpoint_bucket BUCKET[/PATH] --topology 4x4x4
    ... -- --embedding_dim 512 --num_layers 5    # flags after `--` go to `recir-dlrmv3 train` as they are
"""

from __future__ import annotations

import argparse
import json
import math
import re
import string
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Datasets `train` synthesises; the others read files from --data_dir (the data bucket)
SYNTHETIC = ("debug", "debug-random")
DATASETS = (*SYNTHETIC, "movielens-1m", "movielens-20m", "kuairand-1k")
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?")  # DNS-1035; pod hostnames add "-workers-0-N"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_TOPOLOGY = re.compile(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}")
RENDEZVOUS_PORT = 29500
COORDINATOR_PORT = 8476


def _bucket(flag: str, value: str) -> tuple[str, str]:
    """`gs://bucket/some/path` or `bucket/some/path` as (bucket, path inside it)."""
    bucket, _, path = value.removeprefix("gs://").partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            f"--{flag} {value!r}: {bucket!r} is not a Cloud Storage bucket name (e.g. my-bucket/runs)"
        )
    return bucket, path.strip("/")


def _volumes(data: tuple[str, str] | None, checkpoints: tuple[str, str]) -> tuple[list[object], list[object]]:
    """(volumeMounts, volumes): the buckets through the Cloud Storage FUSE CSI driver, /dev/shm in memory
    (DataLoader workers and NCCL need more than the container default of 64 MiB)."""

    def fuse(name: str, bucket: str, read_only: bool) -> dict[str, object]:
        attributes = {"bucketName": bucket, "mountOptions": "implicit-dirs"}
        return {"name": name, "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": read_only,
                                      "volumeAttributes": attributes}}  # fmt: skip

    mounts: list[object] = [{"name": "checkpoints", "mountPath": "/checkpoints"},
                            {"name": "dshm", "mountPath": "/dev/shm"}]  # fmt: skip
    volumes: list[object] = [fuse("checkpoints", checkpoints[0], False),
                             {"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # fmt: skip
    if data is not None:
        mounts.append({"name": "data", "mountPath": "/data", "readOnly": True})
        volumes.append(fuse("data", data[0], True))
    return mounts, volumes


def train_flags(args: argparse.Namespace, devices: int) -> list[str]:
    """The `recir-dlrmv3 train` flags both jobs share (the entry point's own flags come first)."""
    if args.batch_size % devices:
        raise ValueError(
            f"--batch_size {args.batch_size} does not split over the job's {devices} accelerators. "
            f"Fix: a multiple of {devices}, e.g. --batch_size {16 * devices}"
        )
    run = "/".join(
        p for p in ("/checkpoints", _bucket("checkpoint_bucket", args.checkpoint_bucket)[1], args.name) if p
    )
    flags = ["--parallel", args.parallel, "--dataset", args.dataset]
    if args.data_bucket:
        path = _bucket("data_bucket", args.data_bucket)[1]
        flags += ["--data_dir", f"/data/{path}" if path else "/data"]
    elif args.dataset not in SYNTHETIC:
        raise ValueError(
            f"--dataset {args.dataset} reads files: pass --data_bucket BUCKET[/PATH] holding them"
        )
    flags += ["--batch_size", str(args.batch_size), "--num_train_batches", str(args.num_train_batches),
              "--checkpoint_dir", f"{run}/checkpoints", "--checkpoint_every", str(args.checkpoint_every),
              "--resume", "--tensorboard_dir", f"{run}/tensorboard"]  # fmt: skip
    return flags + args.train_args


def render(args: argparse.Namespace) -> str:
    """The JobSet for `args` (render.py's parsed flags) as YAML text."""
    if not _NAME.fullmatch(args.name):
        raise ValueError(
            f"--name {args.name!r}: expected lower-case letters, digits and '-', at most 40, e.g. dlrm-1"
        )
    data = _bucket("data_bucket", args.data_bucket) if args.data_bucket else None
    mounts, volumes = _volumes(data, _bucket("checkpoint_bucket", args.checkpoint_bucket))
    values: dict[str, object] = {
        "name": args.name,
        "image": args.image,
        "service_account": args.service_account,
        "max_restarts": args.max_restarts,
        "volume_mounts": mounts,
        "volumes": volumes,
    }
    if args.kind == "gpu":
        devices = args.nodes * args.gpus_per_node
        endpoint = f"{args.name}-workers-0-0.{args.name}:{RENDEZVOUS_PORT}"
        launcher = ["torchrun", f"--nnodes={args.nodes}", f"--nproc-per-node={args.gpus_per_node}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={args.name}",
                    "-m", "recir.examples.dlrmv3.gpu.train"]  # fmt: skip
        values |= {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "accelerator": args.accelerator,
                   "command": launcher + train_flags(args, devices)}  # fmt: skip
    else:
        if not _TOPOLOGY.fullmatch(args.topology):
            raise ValueError(f"--topology {args.topology!r}: expected AxB or AxBxC, e.g. 2x2x2")
        chips = math.prod(int(d) for d in args.topology.split("x"))
        if chips % args.chips_per_host:
            raise ValueError(
                f"--topology {args.topology} has {chips} chips, not a multiple of --chips_per_host "
                f"{args.chips_per_host}. Fix: the slice's chips per TPU VM (4 on v4/v5p, 8 or 4 on v5e/v6e)"
            )
        hosts = chips // args.chips_per_host
        entry = ["python", "-m", "recir.examples.dlrmv3.tpu.train", "--multihost", "--mesh", f"data={chips}"]
        values |= {"hosts": hosts, "hosts_text": str(hosts), "chips_per_host": args.chips_per_host,
                   "tpu_type": args.tpu_type, "topology": args.topology,
                   "coordinator": f"{args.name}-slice-0-0.{args.name}:{COORDINATOR_PORT}",
                   "command": entry + train_flags(args, chips)}  # fmt: skip
    template = string.Template((HERE / f"jobset-{args.kind}.yaml").read_text())
    # JSON is YAML: every value is a quoted string, a number or a flow collection, whatever it holds
    return template.substitute({k: json.dumps(v) for k, v in values.items()})


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="render.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    kinds = p.add_subparsers(dest="kind", required=True)
    gpu = kinds.add_parser("gpu", help="multi-node GPU job (torchrun, c10d rendezvous)")
    gpu.add_argument("--nodes", type=_positive, default=2, help="GPU nodes (default %(default)s)")
    gpu.add_argument("--gpus_per_node", type=_positive, default=8, help="default %(default)s")
    gpu.add_argument(
        "--accelerator", default="nvidia-h100-80gb", help="GKE accelerator label (default %(default)s)"
    )
    tpu = kinds.add_parser("tpu", help="multi-host TPU slice job (one JAX process per host)")
    tpu.add_argument(
        "--tpu_type", default="tpu-v5p-slice", help="GKE TPU accelerator label (default %(default)s)"
    )
    tpu.add_argument(
        "--topology", default="2x2x2", help="slice topology, e.g. 2x2x2, 4x4 (default %(default)s)"
    )
    tpu.add_argument(
        "--chips_per_host", type=_positive, default=4, help="TPU chips per host (default %(default)s)"
    )
    for sub in (gpu, tpu):
        sub.add_argument(
            "--image", required=True, help="the image built from deploy/docker/Dockerfile.<kind>"
        )
        sub.add_argument(
            "--checkpoint_bucket", required=True, help="BUCKET[/PATH] for checkpoints and TensorBoard"
        )
        sub.add_argument("--data_bucket", default=None, help="BUCKET[/PATH] holding the prepared dataset")
        sub.add_argument(
            "--name", default="recir-dlrmv3", help="JobSet name, also the run's folder (default %(default)s)"
        )
        sub.add_argument("--dataset", choices=DATASETS, default="debug", help="default %(default)s")
        sub.add_argument("--parallel", choices=("dp", "fsdp", "hybrid", "auto"), default="hybrid",
                         help="default %(default)s")  # fmt: skip
        sub.add_argument(
            "--batch_size", type=_positive, default=None, help="global batch (default 16 per accelerator)"
        )
        sub.add_argument("--num_train_batches", type=_positive, default=1000, help="default %(default)s")
        sub.add_argument("--checkpoint_every", type=_positive, default=100, help="default %(default)s")
        sub.add_argument(
            "--max_restarts", type=int, default=3, help="JobSet restarts, each resuming (default %(default)s)"
        )
        sub.add_argument("--service_account", default="default",
                         help="Kubernetes service account with access to the buckets (default %(default)s)")  # fmt: skip
        sub.add_argument("--out", default=None, help="write here instead of stdout")
        sub.add_argument(
            "train_args", nargs=argparse.REMAINDER, help="after `--`: more `recir-dlrmv3 train` flags"
        )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if args.batch_size is None:
        devices = args.nodes * args.gpus_per_node if args.kind == "gpu" else 0
        if args.kind == "tpu" and _TOPOLOGY.fullmatch(args.topology):
            devices = math.prod(int(d) for d in args.topology.split("x"))
        args.batch_size = 16 * max(devices, 1)
    try:
        text = render(args)
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
