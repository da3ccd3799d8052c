"""The `recir-dlrmv3` console script: `train`, `parity`, `export`, `predict` and `prepare` subcommands."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from ._config import (
    COMPILE_REGIONS,
    DATASETS,
    EMBEDDING_BACKENDS,
    MATMUL_PRECISIONS,
    OPTIMIZERS,
    PARALLEL,
    PRECISIONS,
    RECOMPUTE,
    REGIONS_FROM_LAYERS,
    TABLE_DTYPES,
    TABLE_SHARDINGS,
    TARGETS,
)


def default_target() -> str:
    """`gpu` (Inductor + FBGEMM) on a CUDA machine; elsewhere `tpu`, the JAX path, which runs on a TPU when
    present and on JAX's CPU backend otherwise: it compiles the default model in about 10-20 s on a 2-core CPU,
    where Inductor's C++ compile takes one to three minutes (pass --target gpu to use it anyway)."""
    import torch

    return "gpu" if torch.cuda.is_available() else "tpu"


def _add_model_and_data(p: argparse.ArgumentParser, defaults: dict[str, object]) -> None:
    d = defaults
    g = p.add_argument_group("data")
    g.add_argument("--dataset", choices=DATASETS, default=d["dataset"], help="dataset (default %(default)s)")
    g.add_argument("--data_dir", default=None, help="directory holding the processed dataset file")
    g.add_argument(
        "--batch_size",
        type=int,
        default=d["batch_size"],
        help="global samples per step, split over data-parallel ranks/devices (default %(default)s)",
    )
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader worker processes (0 = inline)")
    g.add_argument("--seed", type=int, default=0, help="seed of the model init, dropout and synthetic data")
    g.add_argument("--num_threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    g.add_argument(
        "--host_memory",
        choices=("retain", "release"),
        default=d["host_memory"],
        help="retain: keep freed host memory for the next step instead of returning it to the OS (glibc; "
        "saves the page faults of re-touching every activation each step); release: the C library's "
        "default (default %(default)s)",
    )
    m = p.add_argument_group("model")
    for name in ("embedding_dim", "num_layers", "num_heads", "uih_len", "num_candidates", "hash_size"):
        m.add_argument(f"--{name}", type=int, default=d[name], help="default %(default)s")
    m.add_argument(
        "--token_budget",
        default=d["token_budget"],
        metavar="N|auto",
        help="pack each train batch: its per-token layers compute only its real tokens, in N rows per "
        "global batch (a batch with more real tokens loses the oldest UIH events of its longest histories "
        "first); auto: the per-batch mean plus two standard deviations of the train data's real tokens "
        "(about 2%% of batches trimmed). Default: off, every padded slot",
    )
    m.add_argument(
        "--token_buckets",
        type=int,
        default=d["token_buckets"],
        metavar="K",
        help="with --token_budget auto: K budgets instead of one, chosen from the real tokens of the first "
        "64 train batches (recir.embedding.suggest_buckets); each batch packs into the smallest that holds "
        "it, one compiled step per budget, all training one state (default %(default)s)",
    )
    m.add_argument("--input_dropout", type=float, default=d["input_dropout"], help="default %(default)s")
    m.add_argument("--layer_dropout", type=float, default=d["layer_dropout"], help="default %(default)s")
    o = p.add_argument_group("optimization")
    o.add_argument("--lr", type=float, default=1e-3, help="dense Adam learning rate (default %(default)s)")
    o.add_argument("--sparse_lr", type=float, default=1e-3, help="table learning rate (default %(default)s)")
    o.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d["optimizer"],
        help="reference: dense Adam + row-wise Adagrad tables (the reference loop's); adam / adagrad: one "
        "optimizer for all parameters (default %(default)s)",
    )
    c = p.add_argument_group("compilation")
    c.add_argument(
        "--target",
        choices=TARGETS,
        default=d["target"],
        help="training path; eager-graph runs the captured step by its interpreter (default: "
        + str(d["target"] or "gpu on a CUDA machine, else tpu, the faster compile on a CPU")
        + ")",
    )
    c.add_argument(
        "--embedding_backend",
        choices=EMBEDDING_BACKENDS,
        default=None,
        help="embedding kernels of a compiled target (default: fbgemm on CUDA, in_graph elsewhere; fbgemm, "
        "--target gpu: FBGEMM's split TBE trains the tables with its fused optimizer outside the graph; cpu, "
        "--target tpu only: tables and their optimizer state on the host, the rest of the step on the "
        "device, for tables larger than device memory)",
    )
    c.add_argument(
        "--cuda_graphs",
        action="store_true",
        help="--target gpu on CUDA: replay the whole compiled step as one CUDA graph (the in-graph id "
        "checks are dropped: they read ids on the host); ignored without a CUDA device",
    )
    c.add_argument(
        "--compile_regions",
        choices=COMPILE_REGIONS,
        default="auto",
        help="--target gpu: 'repeated' compiles each STU layer's forward, backward and optimizer code once "
        "and runs it for every layer (recir.lower_gpu.GPUOptions(regions='repeated'): a shorter cold compile); "
        f"'whole' gives Inductor the step as one graph; 'auto' (default): repeated from {REGIONS_FROM_LAYERS} "
        "layers on the CPU device in one process without --recompute layers|auto, else whole",
    )
    c.add_argument(
        "--attention_kernel",
        choices=("inductor", "triton"),
        default="inductor",
        help="--target gpu --recompute attention on CUDA: the attention op's kernels; 'inductor' (default) "
        "generates them from the op's ATen reference, 'triton' runs RecIR's fused Triton kernels, which never "
        "hold the scores (recir.lower_gpu.GPUOptions(hstu_attention='triton'); checked in Triton's "
        "interpreter, not yet timed on a GPU)",
    )
    c.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=d["precision"],
        help="fp32, or bf16: matrix products in bf16 with fp32 master weights and optimizer state "
        "(recir-mixed-precision on the captured step; torch.autocast on --target eager) (default %(default)s)",
    )
    c.add_argument(
        "--table_dtype",
        choices=TABLE_DTYPES,
        default=d["table_dtype"],
        help="how the embedding tables are stored: fp32, or fp16 / bf16 (half the bytes; the reference stores "
        "fp16): lookups widen the gathered rows, each update runs in fp32 and rounds stochastically, the "
        "optimizer state stays fp32 (recir-embed-table-dtype on the captured step; --target gpu, tpu or "
        "eager-graph, embedding backend in_graph) (default %(default)s)",
    )
    c.add_argument(
        "--matmul_precision",
        choices=MATMUL_PRECISIONS,
        default=None,
        help="torch.set_float32_matmul_precision for the run: how float32 matrix products are computed. On "
        "--target tpu the passes of bf16 products per float32 product (highest: about six, the CPU's result; "
        "high: three; medium: one, what JAX does by default), on CUDA whether TF32 is used. Default: torch's "
        "setting (highest unless changed)",
    )
    c.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default=d["recompute"],
        help="recir-recompute-activations on the captured step: none; layers (each STU layer's activations "
        "recomputed in the backward from the layer's input: activation checkpointing); auto (elementwise "
        "values and norms recomputed, matrix products kept); attention (each STU attention's backward "
        "recomputes its scores instead of keeping them: less memory at long sequences, also on --target "
        "eager) (default %(default)s)",
    )
    c.add_argument(
        "--mask_padding",
        action="store_true",
        default=d["mask_padding"],
        help="recir-embed-mask-padding on the captured step: marks the batch's jagged id features and zeroes "
        "the padded positions of their unpooled lookups, forward and table gradient (DLRMv3's KJT lookups "
        "already mask theirs: the start line says what it found)",
    )
    c.add_argument(
        "--pipeline_sparse",
        type=int,
        default=d["pipeline_sparse"],
        metavar="STAGES",
        help="recir-pipeline-sparse on the captured step: 0 off; N >= 2 computes the next N-1 batches' "
        "batch-only sparse work (the ids' all-to-alls under --parallel, id arithmetic) during this batch's "
        "step, carried in state; exact (the losses and parameters of the unpipelined run) (default %(default)s)",
    )


def _add_logging(p: argparse.ArgumentParser) -> None:
    from ._logs import LEVELS

    g = p.add_argument_group("logging")
    g.add_argument(
        "--log_level",
        choices=LEVELS,
        default="info",
        help="level of recir-dlrmv3's own log lines; other libraries log from warning up (default %(default)s)",
    )
    g.add_argument("--log_file", default=None, help="also append the log lines to this file")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("recir-dlrmv3")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
        return "unknown"


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _parser(train_target: str | None = None) -> argparse.ArgumentParser:
    """The CLI; `train_target` is train's default --target (None: default_target() after parsing)."""
    from ._options import TrainOptions

    defaults = {f.name: f.default for f in dataclasses.fields(TrainOptions)}
    # None: default_target() after parsing (it imports torch; --help need not)
    defaults["target"] = train_target
    parser = argparse.ArgumentParser(prog="recir-dlrmv3", description="DLRMv3 (HSTU ranking) on RecIR.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train DLRMv3", description="Train DLRMv3 on one target.")
    _add_model_and_data(t, defaults)
    _add_logging(t)
    r = t.add_argument_group("run")
    r.add_argument(
        "--num_train_batches", type=int, default=defaults["num_train_batches"], help="default %(default)s"
    )
    r.add_argument("--log_every", type=int, default=defaults["log_every"], help="default %(default)s")
    r.add_argument(
        "--dry_run",
        action="store_true",
        help="check the flags, data and checkpoint directory and build the model, then exit without "
        "training (no device, process group or JAX job is started)",
    )
    r.add_argument("--eval_every", type=int, default=0, help="evaluate every N steps (0: at the end only)")
    r.add_argument(
        "--num_eval_batches", type=int, default=defaults["num_eval_batches"], help="default %(default)s"
    )
    d = t.add_argument_group("distribution")
    d.add_argument(
        "--parallel",
        choices=PARALLEL,
        default="none",
        help="GPU path (--target gpu or eager-graph) under torchrun --nproc-per-node N: dp (data parallel), "
        "fsdp, hybrid (dp dense + table-wise tables), auto; with --target tpu --mesh: how the plan "
        "shards the global step (default %(default)s; dp when --mesh is given)",
    )
    d.add_argument(
        "--mesh", default=None, help="TPU path device mesh, e.g. data=8 or data=2,model=2 (--target tpu)"
    )
    d.add_argument(
        "--table_sharding",
        choices=TABLE_SHARDINGS,
        default=None,
        help="how a distributed run (--target tpu --mesh, or --parallel under torchrun) places the embedding "
        "tables: row-, table- or column-wise next to data-parallel dense state (FSDP with --parallel fsdp), "
        "or auto: the planner's choice by --hbm_budget_gib; the planner logs each choice's communication "
        "bytes per step (default: --parallel's own placement)",
    )
    d.add_argument(
        "--hbm_budget_gib",
        type=float,
        default=None,
        help="memory budget per device, GiB of state: --table_sharding auto (and --parallel auto) places "
        "tables by it, and every plan must fit it (default: unlimited)",
    )
    d.add_argument(
        "--multihost",
        action="store_true",
        help="TPU path: join a multi-process JAX job (one process per host, jax.distributed); the "
        "coordinator, process count and id come from the flags below, JAX_COORDINATOR_ADDRESS / "
        "JAX_NUM_PROCESSES / JAX_PROCESS_ID, or JAX's cluster auto-detection (Cloud TPU, SLURM)",
    )
    d.add_argument(
        "--coordinator", default=None, help="multi-host: process 0's HOST:PORT (implies --multihost)"
    )
    d.add_argument("--num_processes", type=int, default=None, help="multi-host: number of processes")
    d.add_argument("--process_id", type=int, default=None, help="multi-host: this process's id, 0..N-1")
    r.add_argument("--tensorboard_dir", default=None, help="write TensorBoard scalars here")
    r.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="profile --profile_steps steps after the compile step: a JAX (TPU path) or torch profiler "
        "trace in DIR, and a table of the time per StepGraph region (TPU path) or per operator",
    )
    r.add_argument(
        "--profile_steps", type=int, default=3, help="steps --profile covers (default %(default)s)"
    )
    r.add_argument(
        "--checkpoint_dir",
        default=None,
        help="write DCP checkpoints here (refused when it holds another run's, unless --resume or --overwrite)",
    )
    r.add_argument("--checkpoint_every", type=int, default=0, help="checkpoint every N steps (0: never)")
    r.add_argument(
        "--keep_checkpoints",
        type=int,
        default=defaults["keep_checkpoints"],
        help="keep this run's N newest checkpoints by write order (default %(default)s)",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the checkpoints of a previous run in --checkpoint_dir before training",
    )
    r.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="resume from PATH, or without PATH from the latest checkpoint in --checkpoint_dir",
    )
    r.add_argument(
        "--allow_fresh_slots",
        type=_patterns,
        default=(),
        metavar="PATTERN[,PATTERN]",
        help="glob patterns of state slots a resume may start fresh or drop (e.g. 'rng:*' across targets)",
    )

    pp = sub.add_parser(
        "parity",
        help="compare eager and compiled training step by step",
        description="Train the same model and batches eagerly and through --target; print per-step "
        "loss / parameter / optimizer-state differences; exit 1 past --atol.",
    )
    parity_defaults = dict(defaults, target=None, input_dropout=0.0, layer_dropout=0.0, optimizer="adagrad")
    _add_model_and_data(pp, parity_defaults)
    _add_logging(pp)
    pp.add_argument(
        "--num_train_batches",
        "--steps",
        dest="steps",
        type=int,
        default=3,
        help="steps to compare, the same flag as train's (--steps: its old name) (default %(default)s)",
    )
    pp.add_argument("--atol", type=float, default=1e-4, help="tolerance (default %(default)s)")

    ex = sub.add_parser(
        "export",
        help="a trained checkpoint as a served model (AOTInductor package or jax.export artifact)",
        description="Rebuild the model from a checkpoint, derive its serving graph (the multitask logits, no "
        "dropout) and write it for the GPU stack (an AOTInductor .pt2, runs with torch alone) or the TPU "
        "stack (a jax.export StableHLO artifact, runs with JAX alone), a manifest (OUT.json) and the "
        "parameters (OUT.state.npz).",
    )
    ex.add_argument("--checkpoint", required=True, help="a step-N checkpoint, or a directory (its latest)")
    ex.add_argument("--target", required=True, choices=("gpu", "tpu"), help="the serving stack")
    ex.add_argument("--out", required=True, help="the artifact's path (OUT.json and OUT.state.npz beside it)")
    ex.add_argument(
        "--quantize",
        choices=("none", "int8", "fp16"),
        default="none",
        help="store the embedding tables int8 (row-wise scale and bias, as FBGEMM) or fp16 (default %(default)s)",
    )
    ex.add_argument(
        "--quantize_kernel",
        choices=("aten", "fbgemm"),
        default="aten",
        help="with --quantize: aten stores scale and bias apart and reads rows in plain ATen (the artifact runs "
        "with torch or JAX alone); fbgemm stores FBGEMM's inference-TBE rows, read by FBGEMM's kernel in the "
        "GPU stack's package (which then needs fbgemm_gpu to load) and in plain JAX on the TPU stack "
        "(default %(default)s)",
    )
    ex.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: the matrix products on bf16 copies of their operands (recir-mixed-precision on --serving "
        "full; the same casts on both cached-history artifacts); parameters and every other op stay fp32 "
        "(default %(default)s)",
    )
    ex.add_argument(
        "--bake", action="store_true", help="compile the parameters into the artifact (no OUT.state.npz)"
    )
    ex.add_argument(
        "--serving",
        choices=("full", "cached-history"),
        default="full",
        help="full: one artifact scoring whole sequences; cached-history: OUT.history (a user's history -> "
        "per-layer key/value cache, once per user) and OUT.candidates (cache + candidates -> logits), "
        "parameters baked (default %(default)s)",
    )
    ex.add_argument(
        "--candidates",
        type=int,
        default=None,
        help="cached-history: candidates per user in the artifact's shapes (default: the trained "
        "--num_candidates; the shapes are static on both stacks: one export per count)",
    )
    ex.add_argument(
        "--platforms",
        type=lambda text: tuple(p for p in text.split(",") if p),
        default=None,
        metavar="LIST",
        help="--target tpu: the JAX platforms to lower the artifact for, comma-separated (cpu, tpu, cuda, "
        "rocm), e.g. tpu,cpu to serve a model exported on a TPU host from CPUs too (default: the exporting "
        "backend)",
    )
    _add_logging(ex)
    pd = sub.add_parser(
        "predict",
        help="run an exported model over eval batches",
        description="Load an artifact written by `export` and print the metrics of `train` (NE, accuracy, "
        "AUC, GAUC per task) over eval batches of its dataset (or --dataset).",
    )
    pd.add_argument("--artifact", required=True, help="the file `export --out` wrote")
    pd.add_argument("--dataset", choices=DATASETS, default=None, help="default: the one it was trained on")
    pd.add_argument("--data_dir", default=None, help="directory holding the processed dataset file")
    pd.add_argument("--num_batches", type=int, default=16, help="eval batches (default %(default)s)")
    _add_logging(pd)

    pr = sub.add_parser(
        "prepare",
        help="convert raw public dataset files",
        description="Convert raw MovieLens (ratings.dat + users.dat, 100K u.data + u.user, 20M ratings.csv) "
        "or KuaiRand-1K (log_*.csv + user_features_1k.csv) files into the files `train` reads.",
    )
    pr.add_argument("--dataset", required=True, choices=("movielens-1m", "movielens-20m", "kuairand-1k"))
    pr.add_argument("--raw_dir", required=True, help="directory with the raw files")
    pr.add_argument("--data_dir", required=True, help="output directory (pass it to train --data_dir)")
    return parser


def _options(args: argparse.Namespace) -> object:
    from ._options import TrainOptions

    names = {f.name for f in dataclasses.fields(TrainOptions)}
    return TrainOptions(**{k: v for k, v in vars(args).items() if k in names})


def _setup_logging(level: str, log_file: str | None) -> None:
    from recir.transforms import ConfigError

    from ._logs import setup_logging

    try:
        setup_logging(level, log_file)
    except OSError as e:
        raise ConfigError(
            f"--log_file {log_file}: cannot open it ({e.strerror}). Fix: pass a path in an existing, writable directory."
        ) from e


def main(argv: list[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))


def train_main(target: str, argv: list[str] | None = None) -> int:
    """`python -m recir.examples.dlrmv3.<target>.train FLAGS`: exactly `recir-dlrmv3 train FLAGS` with
    `target` as the default --target."""
    args = sys.argv[1:] if argv is None else list(argv)
    return _run(_parser(train_target=target).parse_args(["train", *args]))


def _run(args: argparse.Namespace) -> int:
    from recir.transforms import RecIRError

    if getattr(args, "target", "") is None:
        args.target = default_target()
    # TorchRec asks torch.fx whether it is tracing on every call; torch logs a warning about that API.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    try:
        if args.command in ("train", "parity", "export", "predict"):
            _setup_logging(args.log_level, args.log_file)
        if args.command in ("export", "predict"):
            from ._export import export_model, predict
            from ._logs import log_info

            if args.command == "export":
                export_model(
                    args.checkpoint,
                    args.target,
                    args.out,
                    log=log_info,
                    quantize=args.quantize,
                    quantize_kernel=args.quantize_kernel,
                    bake=args.bake,
                    serving=args.serving,
                    candidates=args.candidates,
                    precision=args.precision,
                    platforms=args.platforms,
                )
            elif args.num_batches < 1:
                print(f"error: --num_batches must be >= 1, got {args.num_batches}", file=sys.stderr)
                return 2
            else:
                predict(args.artifact, args.num_batches, args.dataset, args.data_dir, log=log_info)
            return 0
        if args.command == "train":
            from ._train import dry_run, train

            if args.dry_run:
                dry_run(_options(args))  # type: ignore[arg-type]
                return 0
            try:
                train(_options(args))  # type: ignore[arg-type]
            finally:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    dist.destroy_process_group()
            return 0
        if args.command == "parity":
            from ._parity import run_parity

            if args.steps < 1:
                print(f"error: --num_train_batches must be >= 1, got {args.steps}", file=sys.stderr)
                return 2
            if not args.atol >= 0:  # NaN too
                print(f"error: --atol must be >= 0, got {args.atol}", file=sys.stderr)
                return 2
            _, ok = run_parity(_options(args), args.steps, atol=args.atol)  # type: ignore[arg-type]
            return 0 if ok else 1
        from ._prepare import prepare_kuairand, prepare_movielens

        fn = prepare_kuairand if args.dataset == "kuairand-1k" else prepare_movielens
        print(f"wrote {fn(args.raw_dir, args.data_dir)}")
        return 0
    except (RecIRError, ImportError) as e:  # ImportError: a missing optional backend, named by its package
        for problem in getattr(e, "problems", None) or [e]:  # CheckpointMismatchError: one line each
            print(f"error: {problem}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
