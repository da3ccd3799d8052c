"""The training loop behind `recir-dlrmv3 train`: data, trainer, logging, TensorBoard, evaluation and
checkpoints with exact resume (state, data position = global step, RNG).
"""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from recir.transforms import ConfigError

from ._batch import Batch, PaddingStats
from ._data import Data, make_data, train_batches
from ._logs import LOGGER, Progress, log_info
from ._metrics import MetricAccumulator
from ._model import DLRMv3
from ._optim import make_optimizers
from ._options import TrainOptions
from ._parallel import check_batch_split, local_batch
from ._profile import StepProfiler
from ._resume import checkpoint_meta, open_checkpoints, restore, resume_point
from ._tensorboard import learning_rates, open_writer, write_hparams
from ._trainers import Trainer, check_parallel, engine, make_trainer


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    compile_seconds: float = 0.0
    ms_per_step: float = float("nan")
    samples_per_second: float = float("nan")
    start_step: int = 0


def _compile_parts(trainer: Any) -> str:
    """Where the TPU path's first-step seconds went: capture (and the lowering's pipeline), torchax's trace to
    StableHLO, then XLA; empty for a lowering that does not report its trace."""
    trace = getattr(getattr(trainer, "compiled", None), "trace_seconds", None)
    capture = getattr(trainer, "capture_seconds", None)
    if trace is None or capture is None:
        return ""
    xla = trainer.compile_seconds - capture - trace
    return f"; capture {capture:.2f}s, trace {trace:.2f}s, XLA {xla:.2f}s"


def resolve_compile_regions(opts: TrainOptions) -> str:
    """--compile_regions as the GPU path compiles it: `auto` is `repeated` for a single-process step of at
    least REGIONS_FROM_LAYERS STU layers on the CPU device (no CUDA device here), without CUDA graphs,
    --pipeline_sparse or --recompute layers|auto, where its cold compile was measured shorter (and its bf16
    step faster; with --recompute attention, whose recomputation is inside each layer, 50.6-53.2 s against
    82.0-94.0 s whole); `whole` elsewhere, including CUDA, where it has not been measured."""
    import torch

    from ._config import REGIONS_FROM_LAYERS, STEP_RECOMPUTE

    if opts.compile_regions != "auto":
        return opts.compile_regions
    repeated = (
        opts.target == "gpu"
        and opts.num_layers >= REGIONS_FROM_LAYERS
        and opts.parallel == "none"
        and not opts.cuda_graphs
        and not opts.pipeline_sparse
        and opts.recompute not in STEP_RECOMPUTE
        and not torch.cuda.is_available()
    )
    return "repeated" if repeated else "whole"


def gpu_options(opts: TrainOptions) -> object:
    """recir.lower_gpu.GPUOptions for --cuda_graphs, --compile_regions and --attention_kernel (None: the
    lowering's defaults)."""
    regions = resolve_compile_regions(opts)
    if not opts.cuda_graphs and regions == "whole" and opts.attention_kernel == "inductor":
        return None
    from recir.lower_gpu import GPUOptions

    return GPUOptions(
        cuda_graphs=opts.cuda_graphs or None,
        regions=regions,  # type: ignore[arg-type]
        hstu_attention=opts.attention_kernel,  # type: ignore[arg-type]
    )


def cpu_has_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX-BF16 in its flags); None where the
    flags cannot be read (not Linux), so nothing is claimed."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool({"avx512_bf16", "amx_bf16"} & set(flags))


def _warn_slow_bf16(opts: TrainOptions) -> None:
    if opts.precision != "bf16" or torch.cuda.is_available() or cpu_has_bf16_units() is not False:
        return
    if opts.target == "tpu":
        import jax

        if jax.default_backend() != "cpu":  # the products run on the accelerator, not this CPU
            return
    LOGGER.warning(
        "--precision bf16 on a CPU without bf16 units (no avx512_bf16 or amx_bf16 flag; torch uses %s): "
        "bf16 matrix products are emulated and run far slower than fp32 here (measured on an AVX2 AMD EPYC: "
        "a 1216x512x2048 product 4.9 s in bf16 against 24 ms in fp32). Fix: use --precision fp32 on this "
        "machine; bf16 pays on CPUs with AMX or AVX512-BF16 and on GPUs.",
        torch.backends.cpu.get_cpu_capability(),
    )


def build(
    opts: TrainOptions, log: Callable[[str], None] = log_info, data: Data | None = None
) -> tuple[DLRMv3, Data, list[torch.optim.Optimizer]]:
    """Model (seeded), data (``data`` if given: the same batches for a second model) and optimizers."""
    opts.check()
    _warn_slow_bf16(opts)
    if opts.num_threads:
        torch.set_num_threads(opts.num_threads)
    if opts.matmul_precision is not None:
        torch.set_float32_matmul_precision(opts.matmul_precision)
    if opts.host_memory != "release":
        from recir.lower_gpu import retain_host_memory

        retain_host_memory()
    config = opts.model_config()
    if data is None:
        data = make_data(
            opts.dataset,
            config,
            batch_size=opts.batch_size,
            seed=opts.seed,
            data_dir=opts.data_dir,
            token_budget=opts.token_budget,
            token_buckets=opts.token_buckets,
        )
        if data.bucket_report:
            log(f"token packing: {data.bucket_report}")
        elif data.token_budget is not None:
            slots = opts.batch_size * (len(data.spec.contextual) + config.uih_len + config.num_candidates)
            log(f"token packing: {data.token_budget} rows per global batch of {slots} padded slots")
    torch.manual_seed(opts.seed)
    model = DLRMv3(data.spec, config)
    model.recompute_attention_scores(opts.recompute == "attention")
    return model, data, make_optimizers(model, opts.lr, opts.sparse_lr, opts.optimizer, opts.target)


def evaluate(trainer: Trainer, data: Data, num_batches: int) -> dict[str, float]:
    """NE / accuracy / AUC / GAUC per task on the first `num_batches` eval batches (no RNG drawn)."""
    model = trainer.sync_model()
    was_training = model.training
    model.eval()
    acc = MetricAccumulator(tuple(t.name for t in data.spec.tasks))
    with torch.no_grad():
        for batch in data.eval_batches(num_batches):
            labels, weights = model.labels(batch)
            acc.update(model(batch), labels, weights)
    model.train(was_training)
    return acc.compute()


def _format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def _setup_parallel(opts: TrainOptions) -> tuple[int, int, Any]:
    """(rank, data-parallel size, TPU mesh or None): starts the process group for --parallel on the GPU
    path, or joins the multi-process JAX job (rank = JAX process index, the batch stays global)."""
    if opts.target == "tpu" and opts.mesh is not None:
        from recir.distributed import Mesh

        process = 0
        if opts.wants_multihost():  # before anything touches JAX's devices
            from recir.lower_tpu import initialize_distributed

            process, _ = initialize_distributed(opts.coordinator, opts.num_processes, opts.process_id)
        mesh = Mesh.parse(opts.mesh, name="--mesh")
        check_batch_split(opts.batch_size, mesh.data_size)
        # every process feeds the global batch; each transfers only its own devices' shards
        return process, 1, mesh
    if opts.parallel == "none" or opts.target not in ("gpu", "eager-graph"):
        return 0, 1, None
    from recir.distributed import setup_process_group

    rank, world = setup_process_group()
    check_batch_split(opts.batch_size, world)
    return rank, world, None


def _local_batches(data: Data, start: int, stop: int, rank: int, world: int) -> Iterator[Batch]:
    for step in range(start, stop):
        yield local_batch(data, step, rank, world)


def _silent(line: str) -> None:
    del line


def _checkpoint(
    opts: TrainOptions,
    trainer: Trainer,
    done: int,
    parallel: str,
    checkpoints: Any,
    log: Callable[[str], None],
) -> None:
    state = trainer.state_dict()  # in every process: gathering sharded JAX state is a collective
    multihost = opts.wants_multihost()  # check() allows it on the TPU path only
    if checkpoints is not None:  # several JAX processes: process 0 alone holds one and writes
        path = checkpoints.save(done, state, trainer.checkpoint_plan, checkpoint_meta(opts, parallel))
        log(f"checkpoint step {done} -> {path}")
    if multihost:
        from recir.lower_tpu import sync_processes

        sync_processes(f"recir-dlrmv3-checkpoint-{done}")


def dry_run(opts: TrainOptions, log: Callable[[str], None] = log_info) -> DLRMv3:
    """`train --dry_run`: every check `train` makes before it trains that needs no device, process group
    or other process (flags, checkpoint directory and a resumed checkpoint, dataset files, mesh syntax and
    batch split, the target's engine), and the model, data and optimizers built; then nothing more."""
    resume_point(opts)  # flags, then the checkpoint directory (reads only)
    model, data, _ = build(opts, log)
    check_parallel(opts.target, opts.parallel, opts.mesh is not None)
    if opts.mesh is not None:
        from recir.distributed import Mesh

        check_batch_split(opts.batch_size, Mesh.parse(opts.mesh, name="--mesh").data_size)
    if opts.target != "eager":
        engine("gpu" if opts.target == "eager-graph" else opts.target)  # installed and importable
    params = sum(p.numel() for p in model.parameters())
    log(
        f"dry run: flags valid; DLRMv3 with {params:,} parameters on {opts.dataset} "
        f"({data.batches_per_epoch} batches of {opts.batch_size} per epoch), target {opts.target}; "
        "nothing trained"
    )
    return model


def _with_lookahead(batches: Iterable[Batch], n: int) -> Iterator[tuple[Batch, list[Batch]]]:
    """Each batch with the (up to) ``n`` batches after it."""
    window: collections.deque[Batch] = collections.deque()
    for batch in batches:
        window.append(batch)
        if len(window) > n:
            yield window.popleft(), list(window)
    while window:
        yield window.popleft(), list(window)


def train(opts: TrainOptions, log: Callable[[str], None] = log_info) -> TrainResult:
    """Runs `opts.num_train_batches` global steps (fewer when resuming) and evaluates at the end.
    `log` gets each line (default: INFO on the `recir.dlrmv3` logger)."""
    resumed = resume_point(opts)  # checkpoint dir, checksums and configuration: before anything is built
    # the process group comes after the build; torchrun's RANK already says which process logs
    model, data, optimizers = build(opts, log if int(os.environ.get("RANK", "0")) == 0 else _silent)
    rank, world, mesh = _setup_parallel(opts)
    if rank != 0:
        log = _silent  # logs from rank 0 only
    parallel = "dp" if mesh is not None and opts.parallel == "none" else opts.parallel
    checkpoints = open_checkpoints(opts, rank, log)  # --overwrite deletes the previous run's here
    start = resumed[1] if resumed else 0
    example = local_batch(data, start, rank, world) if world > 1 else data.train_batch(start)
    trainer = make_trainer(
        opts.target,
        model,
        optimizers,
        example,
        opts.embedding_backend,
        parallel=parallel,
        mesh=mesh,
        precision=opts.precision,
        compile_options=gpu_options(opts),
        table_sharding=opts.table_sharding,
        hbm_budget_gib=opts.hbm_budget_gib,
        recompute=opts.recompute,
        token_buckets=data.token_buckets,
        pipeline_sparse=opts.pipeline_sparse,
        mask_padding=opts.mask_padding,
        table_dtype=opts.table_dtype,
    )
    for line in getattr(trainer, "plan_lines", []):  # placements and each choice's traffic per step
        log(line)
    if resumed:
        # the checkpoint may come from another plan, world size or path: read this trainer's shards
        for line in restore(trainer, resumed[0], opts):  # a table stored in another --table_dtype
            log(line)
        log(f"resumed from step {start} ({resumed[0]})")
    writer = None
    if opts.tensorboard_dir and rank == 0:  # scalars at the console's step numbers (steps done)
        writer = open_writer(opts.tensorboard_dir, opts)
        log(f"tensorboard: {writer.log_dir}")
    result = TrainResult(start_step=start)
    progress = Progress(opts.num_train_batches if rank == 0 else 0, start)
    window_t, window_n, timed_t, timed_n = time.perf_counter(), 0, 0.0, 0
    batches = (
        _local_batches(data, start, opts.num_train_batches, rank, world)
        if world > 1
        else train_batches(data, start, opts.num_train_batches, opts.num_workers)
    )
    profiler = (
        StepProfiler(opts.profile, opts.target, trainer, start + 1, opts.profile_steps, log)
        if opts.profile and rank == 0
        else None
    )
    lookahead = trainer.lookahead  # --pipeline_sparse: the step also sees the next batches
    for step, (batch, upcoming) in enumerate(_with_lookahead(batches, lookahead), start):
        data.stats.add(batch)
        if profiler is not None:
            profiler.before(step)
        t0 = time.perf_counter()
        loss_t, _ = trainer.step(batch, upcoming)
        loss = float(loss_t)
        dt = time.perf_counter() - t0
        if profiler is not None:
            profiler.after(step)
        if step == start:
            result.compile_seconds = trainer.compile_seconds
            regions = f", --compile_regions {resolve_compile_regions(opts)}" if opts.target == "gpu" else ""
            log(f"train step compiled in {trainer.compile_seconds:.2f}s ({trainer.description}{regions})"
                + _compile_parts(trainer))  # fmt: skip
            if writer is not None:
                writer.add_scalar("perf/compile_seconds", trainer.compile_seconds, step + 1)
            window_t, window_n = time.perf_counter(), 0
        else:
            timed_t, timed_n, window_n = timed_t + dt, timed_n + 1, window_n + 1
        if not math.isfinite(loss):
            raise ConfigError(f"step {step}: the loss is {loss}; lower --lr or check the data")
        result.losses.append(loss)
        done = step + 1
        if writer is not None:
            writer.add_scalar("train/loss", loss, done)
        if done % opts.log_every == 0:
            ms = 1000 * (time.perf_counter() - window_t) / window_n if window_n else 1000 * dt
            log(f"epoch {step // data.batches_per_epoch} step {done} loss {loss:.6f} ({ms:.1f} ms/step)")
            if writer is not None:
                writer.add_scalar("perf/ms_per_step", ms, done)
                writer.add_scalar("perf/samples_per_second", 1000 * opts.batch_size / max(ms, 1e-9), done)
                for group, lr in learning_rates(model, optimizers).items():
                    writer.add_scalar(f"train/lr/{group}", lr, done)
            window_t, window_n = time.perf_counter(), 0
        if opts.eval_every and done % opts.eval_every == 0 and done < opts.num_train_batches:
            metrics = evaluate(trainer, data, opts.num_eval_batches)
            log(f"eval step {done}: {_format_metrics(metrics)}")
            if writer is not None:
                for k, v in metrics.items():
                    writer.add_scalar(f"eval/{k}", v, done)
        if opts.checkpoint_every and done % opts.checkpoint_every == 0:
            _checkpoint(opts, trainer, done, parallel, checkpoints, log)
        progress.update(done, loss)
    progress.close()
    if profiler is not None:
        profiler.close()  # a run shorter than the profiled window
    if world > 1:  # padding waste over the global batches, not rank 0's slices only
        import torch.distributed as dist

        counts = torch.tensor([data.stats.real, data.stats.padded], dtype=torch.int64)
        dist.all_reduce(counts)
        data.stats = PaddingStats(int(counts[0]), int(counts[1]))
    result.metrics = evaluate(trainer, data, opts.num_eval_batches)
    if writer is not None:
        for k, v in result.metrics.items():
            writer.add_scalar(f"eval/{k}", v, opts.num_train_batches)
        writer.add_scalar("train/padding_waste", data.stats.waste, opts.num_train_batches)
        write_hparams(writer, opts, result.metrics)
        writer.close()
    if timed_n:
        result.ms_per_step = 1000 * timed_t / timed_n
        result.samples_per_second = opts.batch_size * timed_n / timed_t
    steps = len(result.losses)
    final = f"{result.losses[-1]:.6f}" if result.losses else "n/a"
    log(
        f"done: target {opts.target}{f' x{world} ranks ({parallel})' if world > 1 else ''}, {steps} steps, {result.samples_per_second:.1f} samples/s "
        f"({result.ms_per_step:.1f} ms/step after compile), final loss {final}, "
        f"padding waste {100 * data.stats.waste:.1f}%; eval: {_format_metrics(result.metrics)}"
    )
    return result
