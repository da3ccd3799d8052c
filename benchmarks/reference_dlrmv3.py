"""Time the reference DLRMv3 training loop (Meta's generative-recommenders) on CPU, unmodified.

What it measures. The reference's own `train_loop` (generative_recommenders/dlrm_v3/train/utils.py)
runs with its debug gin config, rank 0 of a world of 1, on the CPU. Two thin hooks time each step
without touching the loop: the train DataLoader is wrapped so a timestamp is taken as each batch is
handed over, and the optimizer's `step` is wrapped so one is taken as it returns. So

    step_ms = optimizer.zero_grad + batch .to(device) + forward + backward (which also runs the fused
              in-backward sparse RowWiseAdagrad update of TorchRec's CPU TBE) + dense Adam step.

Not in step_ms: generating and collating the random debug batch, and the reference's per-step metric
update / compute_and_log (tensorboard). `iter_ms` (one step's start to the next one's) includes both and
is printed for information. The final line is `REF max_seq_len=<n> batch=<b> median_ms=<x> steps=<k>`:
the median step_ms over the steps after `--warmup`.

Checked against reference commit db1bf8f ("Enable multirow concat/split 2D jagged kernels on H100
(sm90+)"); benchmarks/reference_setup.sh clones and pins it.

Model settings, as docs/dlrmv3-reference.md's figures were taken: the debug config (5 HSTU layers,
4 heads, width 512, batch 16), `hstu_config.max_seq_len = --max_seq_len` (the dataclass default is 16384
and the debug config leaves it), the three tables capped at `--table_rows` rows (10M upstream) and
stored in fp32 (fp16 upstream; `--emb_dtype fp16`), `bf16_training=False` (upstream: bf16 autocast on
CUDA), `HammerKernel.PYTORCH` kernels (upstream: Triton), and gin bindings on top of debug.gin:
`train_loop.num_batches = --steps`, `make_train_test_dataloaders.batch_size = --batch_size` (debug.gin's
is 16), `train_loop.output_trace = False` (debug.gin turns on the torch profiler with CUDA activity), no
checkpoint inside the run, tensorboard logs in a temporary folder. The REF line also gives the process's
peak resident set (`peak_rss_gib`, getrusage), what `benchmarks/dlrmv3.py` compares RSS against.
`--seed` seeds torch; `--threads` (default 2) sets torch's thread count.

Like for like with RecIR: the reference's max_seq_len counts the 2 contextual tokens and the 10
candidate slots, so RecIR `--uih_len 64` equals reference `--max_seq_len 76` (256 -> 268). The
reference's debug data draws each sample's UIH length uniformly from [int(0.8 U), U] with
U = max_seq_len - 10 - 2, and its candidate count uniformly from 1 to 10.

Run-time patches (so a fresh, unedited checkout runs on a CPU-only machine):
 1. `torchrec.modules.sorted_index_select`: the reference's pt_jagged.py imports it, and older
    TorchRec releases (1.5.1 among them) lack it. When the import fails, a stand-in module is
    registered under that name whose `maybe_sorted_index_select(embeddings, indices, use_sorted)` is
    `embeddings.index_select(0, indices)`, TorchRec's own path when `use_sorted` is false (it is unless
    TORCHREC_SORTED_INDEX_SELECT=1; the sorted path is a Triton GPU kernel). It refuses use_sorted.
 2. The reference's `setup()` hard-codes an NCCL process group and `torch.cuda.set_device`, both of
    which fail without a GPU. It is not called; this script does what it does with gloo instead:
    MASTER_ADDR/MASTER_PORT (a free port), `init_process_group` (rank 0, world size 1) and a
    `new_group` with the same 1800 s timeout.
 3. `make_optimizer_and_shard` plans sharding with `Topology(compute_device="cuda")`, which puts the
    shards on cuda:0, and DistributedModelParallel on the CPU then fails. The name `Topology` in the
    reference module is replaced, for that call only, by a wrapper that sets compute_device to the run's
    device type ("cpu"). The plan is then table-wise on the fused CPU TBE with exact row-wise Adagrad.

Use: benchmarks/reference_setup.sh prints the command; or
    python benchmarks/reference_dlrmv3.py --gr_dir PATH/generative-recommenders --deps_dir PATH/deps
with a Python that has torch, torchrec and fbgemm-gpu (RecIR's environment does).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, NoReturn

REFERENCE_COMMIT = "db1bf8f"
REFERENCE_URL = "https://github.com/meta-recsys/generative-recommenders"
EXTRA_DEPS = "gin-config pandas python-dateutil six pytz tzdata"
DEFAULT_GR_DIR = os.path.join(".reference", "generative-recommenders")
DEFAULT_DEPS_DIR = os.path.join(".reference", "deps")  # where reference_setup.sh installs EXTRA_DEPS
UTILS_FILE = os.path.join("generative_recommenders", "dlrm_v3", "train", "utils.py")
SORTED_INDEX_SELECT = "torchrec.modules.sorted_index_select"


def _fail(message: str) -> NoReturn:
    print(f"reference_dlrmv3.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _deps_hint() -> str:
    return (
        f"install the reference's extra pure-Python packages into a folder, e.g. "
        f"`python -m pip install --target DIR --no-deps {EXTRA_DEPS}`, and pass --deps_dir DIR "
        f"(benchmarks/reference_setup.sh does this)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Time Meta's generative-recommenders DLRMv3 reference train_loop on CPU (debug config, "
            "pure-PyTorch kernels, fp32), unmodified, with run-time patches instead of source edits. "
            "Prints one line per step and a final 'REF max_seq_len=.. batch=.. median_ms=.. steps=.. peak_rss_gib=..' line."
        )
    )
    p.add_argument(
        "--gr_dir",
        default=DEFAULT_GR_DIR,
        help=f"a generative-recommenders checkout (commit {REFERENCE_COMMIT}); put first on sys.path "
        "(default %(default)s, where benchmarks/reference_setup.sh clones it)",
    )
    p.add_argument(
        "--deps_dir",
        default=DEFAULT_DEPS_DIR if os.path.isdir(DEFAULT_DEPS_DIR) else None,
        help=f"extra sys.path folder holding {EXTRA_DEPS} (not needed when they are installed; default "
        f"{DEFAULT_DEPS_DIR} where benchmarks/reference_setup.sh puts them, when it exists)",
    )
    p.add_argument(
        "--max_seq_len",
        type=int,
        default=76,
        help="reference max_seq_len: UIH + 2 contextual + 10 candidates (default %(default)s = RecIR UIH 64)",
    )
    p.add_argument(
        "--batch_size",
        type=int,
        default=16,
        help="samples per step (make_train_test_dataloaders.batch_size; debug.gin's is 16) (default %(default)s)",
    )
    p.add_argument(
        "--steps", type=int, default=10, help="training steps, warm-up included (default %(default)s)"
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="first steps left out of the median (default %(default)s)"
    )
    p.add_argument(
        "--table_rows", type=int, default=100_000, help="cap on each table's rows (default %(default)s)"
    )
    p.add_argument(
        "--emb_dtype",
        choices=("fp32", "fp16"),
        default="fp32",
        help="embedding table dtype; fp16 is the reference's own (default %(default)s)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="torch seed: weights and debug batches (default %(default)s)"
    )
    p.add_argument(
        "--num_layers",
        type=int,
        default=None,
        help="override the 5 HSTU layers; only for tiny smoke tests, the figures use the default",
    )
    p.add_argument(
        "--verbose", action="store_true", help="keep Python warnings and the reference's log lines"
    )
    args = p.parse_args(argv)
    if args.max_seq_len <= 12:
        p.error(
            f"--max_seq_len {args.max_seq_len} leaves no UIH: it counts 2 contextual tokens and 10 candidates"
        )
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} so some steps are timed")
    for name in ("table_rows", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.num_layers is not None and args.num_layers < 1:
        p.error("--num_layers must be at least 1")
    return args


def _prepare_sys_path(gr_dir: str, deps_dir: str | None) -> str:
    """Check the checkout and put it (and the deps folder) first on sys.path; returns its absolute path."""
    gr_dir = os.path.abspath(os.path.expanduser(gr_dir))
    if not os.path.isdir(gr_dir):
        _fail(
            f"--gr_dir {gr_dir} does not exist. Clone the reference with `bash benchmarks/reference_setup.sh "
            f"[DIR]` (or `git clone {REFERENCE_URL} && git -C generative-recommenders checkout "
            f"{REFERENCE_COMMIT}`) and pass --gr_dir to the checkout"
        )
    if not os.path.isfile(os.path.join(gr_dir, UTILS_FILE)):
        _fail(
            f"--gr_dir {gr_dir} is not a generative-recommenders checkout: it has no {UTILS_FILE}. "
            f"Pass the folder that contains generative_recommenders/ (the root of a clone of {REFERENCE_URL})"
        )
    if deps_dir is not None:
        deps_dir = os.path.abspath(os.path.expanduser(deps_dir))
        if not os.path.isdir(deps_dir):
            _fail(f"--deps_dir {deps_dir} does not exist; {_deps_hint()}")
        sys.path.insert(0, deps_dir)
    sys.path.insert(0, gr_dir)
    return gr_dir


def _checkout_commit(gr_dir: str) -> str | None:
    """The checkout's commit, when it is a git clone (an archive has none)."""
    if not os.path.exists(os.path.join(gr_dir, ".git")):
        return None
    try:
        out = subprocess.run(
            ["git", "-C", gr_dir, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _patch_sorted_index_select() -> bool:
    """Patch 1: give TorchRec releases without sorted_index_select a stand-in. True when it was needed."""
    try:
        importlib.import_module(SORTED_INDEX_SELECT)
        return False
    except ModuleNotFoundError as e:
        if e.name != SORTED_INDEX_SELECT:
            raise

    def maybe_sorted_index_select(embeddings: Any, indices: Any, use_sorted: bool) -> Any:
        if use_sorted:
            raise RuntimeError(
                "TORCHREC_SORTED_INDEX_SELECT=1 asks for TorchRec's sorted index_select, which this TorchRec "
                "does not have; unset TORCHREC_SORTED_INDEX_SELECT or install a newer torchrec"
            )
        return embeddings.index_select(0, indices)

    standin = types.ModuleType(SORTED_INDEX_SELECT)
    standin.__doc__ = "Stand-in from benchmarks/reference_dlrmv3.py: the non-sorted path only."
    standin.maybe_sorted_index_select = maybe_sorted_index_select  # type: ignore[attr-defined]
    sys.modules[SORTED_INDEX_SELECT] = standin
    parent = importlib.import_module("torchrec.modules")
    parent.sorted_index_select = standin  # type: ignore[attr-defined]
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def _init_distributed_cpu() -> None:
    """Patch 2: what the reference's setup() does for rank 0 of 1, with gloo and no CUDA device."""
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(_free_port())
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    dist.new_group(backend="gloo", timeout=timedelta(seconds=1800))


@contextlib.contextmanager
def _planner_on_device(module: types.ModuleType, device_type: str) -> Iterator[list[str]]:
    """Patch 3: while active, `Topology(...)` in `module` plans for `device_type`, whatever it was asked for."""
    original = module.Topology
    asked: list[str] = []

    def topology_on_device(*args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2:  # Topology(world_size, compute_device, ...)
            asked.append(str(args[1]))
            args = (args[0], device_type, *args[2:])
        else:
            asked.append(str(kwargs.get("compute_device")))
            kwargs["compute_device"] = device_type
        return original(*args, **kwargs)

    module.Topology = topology_on_device
    try:
        yield asked
    finally:
        module.Topology = original


class _Stamps:
    def __init__(self) -> None:
        self.start: list[float] = []
        self.end: list[float] = []


class _StampedLoader:
    """Hands the reference loop the batches of `loader` unchanged, noting when each is handed over.

    Keeps `sampler` and `batch_size`, which train_loop and MetricsLogger read."""

    def __init__(self, loader: Any, stamps: _Stamps) -> None:
        self._loader = loader
        self._stamps = stamps
        self.sampler = loader.sampler
        self.batch_size = loader.batch_size

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._loader:
            self._stamps.start.append(time.perf_counter())
            yield batch


def _import_reference() -> dict[str, Any]:
    """Import the reference modules the run needs, with clear errors for the usual missing packages."""
    for engine in ("torch", "torchrec", "fbgemm_gpu"):
        try:
            importlib.import_module(engine)
        except ModuleNotFoundError as e:
            _fail(
                f"{engine} is not importable ({e}); run with a Python that has torch, torchrec and "
                f"fbgemm-gpu (or fbgemm-gpu-cpu), e.g. RecIR's .venv/bin/python"
            )
    _patch_sorted_index_select()
    try:
        return {
            name: importlib.import_module(f"generative_recommenders.{name}")
            for name in (
                "common",
                "dlrm_v3.checkpoint",
                "dlrm_v3.configs",
                "dlrm_v3.train.utils",
                "dlrm_v3.utils",
                "modules.dlrm_hstu",
            )
        }
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top in {"pandas", "dateutil", "six", "pytz", "tzdata", "gin"}:
            _fail(f"the reference needs '{e.name}', which is not importable; {_deps_hint()}")
        raise


def run(args: argparse.Namespace) -> float:
    """Build the reference model, run its train_loop for --steps steps and print the timings; returns median ms."""
    gr_dir = _prepare_sys_path(args.gr_dir, args.deps_dir)
    commit = _checkout_commit(gr_dir)
    if commit is not None and not commit.startswith(REFERENCE_COMMIT):
        print(
            f"note: {gr_dir} is at {commit[:12]}, not {REFERENCE_COMMIT}, the commit this harness was checked against"
        )

    try:  # before torch's slow import, so a missing --deps_dir fails at once
        importlib.import_module("gin")
    except ModuleNotFoundError:
        _fail(f"gin-config is not importable (module 'gin'); {_deps_hint()}")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    if not args.verbose:
        warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(args.threads)

    ref = _import_reference()
    if not args.verbose:
        logging.getLogger().setLevel(logging.WARNING)
        ref["dlrm_v3.train.utils"].logger.setLevel(logging.ERROR)  # "Setting epoch to ..." every run
    import gin
    import torch.distributed as dist
    from torchrec.modules.embedding_configs import DataType

    ref_utils = ref["dlrm_v3.train.utils"]
    loaded_from = os.path.abspath(ref_utils.__file__)
    if not loaded_from.startswith(gr_dir + os.sep):
        _fail(
            f"generative_recommenders was imported from {loaded_from}, not from --gr_dir {gr_dir}; "
            "uninstall that copy or run from another folder"
        )
    hammer_kernel = ref["common"].HammerKernel.PYTORCH
    configs = ref["dlrm_v3.configs"]
    emb_dtype = {"fp32": DataType.FP32, "fp16": DataType.FP16}[args.emb_dtype]
    dataset = "debug"
    device = torch.device("cpu")
    rank, world_size = 0, 1

    torch.manual_seed(args.seed)
    _init_distributed_cpu()
    tb_dir = tempfile.mkdtemp(prefix="reference_dlrmv3_tb_")
    try:
        gin.parse_config_files_and_bindings(
            [os.path.join(os.path.dirname(ref_utils.__file__), "gin", "debug.gin")],
            bindings=[
                f"train_loop.num_batches = {args.steps}",
                f"make_train_test_dataloaders.batch_size = {args.batch_size}",
                "train_loop.output_trace = False",
                f"train_loop.checkpoint_frequency = {args.steps + 1}",
                f"MetricsLogger.tensorboard_log_path = {tb_dir!r}",
            ],
        )

        # The reference's make_model(dataset="debug"), with the settings it does not expose.
        hstu_config = configs.get_hstu_configs(dataset)
        hstu_config.max_seq_len = args.max_seq_len
        if args.num_layers is not None:
            hstu_config.hstu_attn_num_layers = args.num_layers
        tables = {
            name: dataclasses.replace(
                table, num_embeddings=min(table.num_embeddings, args.table_rows), data_type=emb_dtype
            )
            for name, table in configs.get_embedding_table_config(dataset).items()
        }
        model = ref["modules.dlrm_hstu"].DlrmHSTU(
            hstu_configs=hstu_config, embedding_tables=tables, is_inference=False, bf16_training=False
        )
        model.set_hammer_kernel(hammer_kernel)

        with _planner_on_device(ref_utils, device.type) as asked:
            model, optimizer = ref_utils.make_optimizer_and_shard(
                model=model, device=device, world_size=world_size
            )
        if not asked:
            _fail(
                "make_optimizer_and_shard no longer builds a Topology in generative_recommenders.dlrm_v3.train.utils, "
                f"so the CPU planner patch did not apply; check out commit {REFERENCE_COMMIT}"
            )
        train_loader, _ = ref_utils.make_train_test_dataloaders(
            hstu_config=hstu_config, embedding_table_configs=tables
        )
        metrics = ref["dlrm_v3.utils"].MetricsLogger(
            multitask_configs=hstu_config.multitask_configs,
            batch_size=train_loader.batch_size,
            window_size=2500,
            device=device,
            rank=rank,
        )
        ref["dlrm_v3.checkpoint"].load_dmp_checkpoint(
            model=model, optimizer=optimizer, metric_logger=metrics, device=device
        )
        print(
            f"config: max_seq_len={args.max_seq_len} batch={train_loader.batch_size} "
            f"layers={hstu_config.hstu_attn_num_layers} heads={hstu_config.hstu_num_heads} "
            f"dim={hstu_config.hstu_transducer_embedding_dim} table_rows={args.table_rows} "
            f"emb_dtype={args.emb_dtype} kernel={hammer_kernel.name} threads={torch.get_num_threads()} "
            f"params={sum(p.numel() for p in model.parameters())} planner_asked={asked[0]}->{device.type}",
            flush=True,
        )

        stamps = _Stamps()
        reference_step = optimizer.step

        def stamped_step(*a: Any, **kw: Any) -> Any:
            out = reference_step(*a, **kw)
            stamps.end.append(time.perf_counter())
            return out

        optimizer.step = stamped_step
        ref_utils.train_loop(
            rank=rank,
            model=model,
            dataloader=_StampedLoader(train_loader, stamps),
            optimizer=optimizer,
            metric_logger=metrics,
            device=device,
        )
        finished = time.perf_counter()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(tb_dir, ignore_errors=True)

    if len(stamps.end) != len(stamps.start) or len(stamps.end) != args.steps:
        _fail(f"expected {args.steps} steps, timed {len(stamps.start)} starts and {len(stamps.end)} ends")
    step_ms = [(e - s) * 1e3 for s, e in zip(stamps.start, stamps.end)]
    iter_ms = [(b - a) * 1e3 for a, b in zip(stamps.start, [*stamps.start[1:], finished])]
    for i, (s, it) in enumerate(zip(step_ms, iter_ms)):
        tag = "  (warm-up)" if i < args.warmup else ""
        print(f"step {i}: step_ms={s:.1f} iter_ms={it:.1f}{tag}")
    timed = step_ms[args.warmup :]
    median = statistics.median(timed)
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    print(
        f"REF max_seq_len={args.max_seq_len} batch={train_loader.batch_size} median_ms={median:.1f} "
        f"steps={len(timed)} peak_rss_gib={peak_gib:.2f}",
        flush=True,
    )
    return median


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
