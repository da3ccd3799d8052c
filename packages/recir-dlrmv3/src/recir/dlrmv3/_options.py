"""`TrainOptions`: every flag of `train`/`parity` as one dataclass (imports no TorchRec, so the CLI's
--help stays fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ._config import ModelConfig, config_error


@dataclass
class TrainOptions:
    """Every `train` flag (the CLI builds one of these)."""

    target: str = "eager"
    dataset: str = "debug"
    data_dir: str | None = None
    batch_size: int = 16
    num_workers: int = 0
    num_train_batches: int = 400
    # Model sizes default to ModelConfig's (one source of truth for the defaults).
    embedding_dim: int = ModelConfig.embedding_dim
    num_layers: int = ModelConfig.num_layers
    num_heads: int = ModelConfig.num_heads
    uih_len: int = ModelConfig.uih_len
    num_candidates: int = ModelConfig.num_candidates
    hash_size: int = ModelConfig.hash_size
    input_dropout: float = ModelConfig.input_dropout
    layer_dropout: float = ModelConfig.layer_dropout
    embedding_backend: str | None = None
    precision: str = "fp32"
    # how the embedding tables are stored: fp32, or fp16/bf16 (recir-embed-table-dtype: float32 updates
    # rounded stochastically, float32 optimizer state; the captured targets only)
    table_dtype: str = "fp32"
    # torch.set_float32_matmul_precision for the run (None: leave torch's setting): the GPU path's TF32 on
    # CUDA, the TPU path's passes per float32 product (recir.lower_tpu follows torch's knob)
    matmul_precision: str | None = None
    # none | layers | auto (recir-recompute-activations) | attention (the model's own; RECOMPUTE)
    recompute: str = "none"
    # recir-embed-mask-padding on the captured step (padded positions of jagged id features zeroed)
    mask_padding: bool = False
    # recir-pipeline-sparse: stages of the software-pipelined step (0: off; 2: batch i+1's ids and sparse
    # inputs computed and sent during batch i's step)
    pipeline_sparse: int = 0
    # real tokens per global train batch that the per-token layers compute (packing): a number, "auto"
    # (recir.dlrmv3.estimate_token_budget) or None (every padded slot)
    token_budget: str | None = None
    # with --token_budget auto: that many budgets (recir.embedding.suggest_buckets over the first 64
    # train batches' real tokens), one compiled step each
    token_buckets: int = 1
    # GPU path on CUDA: replay the whole step as one CUDA graph (the id checks then leave the graph)
    cuda_graphs: bool = False
    # GPU path: "repeated" compiles each repeated layer's code once (recir.lower_gpu GPUOptions.regions),
    # "whole" the step as one graph, "auto" repeated where it was measured to pay (resolve_compile_regions)
    compile_regions: str = "auto"
    # GPU path on CUDA with --recompute attention: the attention op's kernels, "inductor" (generated from
    # its ATen reference) or "triton" (RecIR's fused kernels; recir.lower_gpu GPUOptions.hstu_attention)
    attention_kernel: str = "inductor"
    log_every: int = 50
    seed: int = 0
    eval_every: int = 0
    num_eval_batches: int = 16
    tensorboard_dir: str | None = None
    # profile --profile_steps steps after the compile step into this directory, then print where time goes
    profile: str | None = None
    profile_steps: int = 3
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: str | None = None
    # a --checkpoint_dir holding another run's checkpoints: --overwrite deletes them before training
    overwrite: bool = False
    # glob patterns of slots a resume may start fresh (missing from the checkpoint) or drop (extra in it)
    allow_fresh_slots: tuple[str, ...] = ()
    lr: float = 1e-3
    sparse_lr: float = 1e-3
    optimizer: str = "reference"
    num_threads: int = 0
    # "retain": freed host memory stays in the process between steps (recir.lower_gpu.retain_host_memory;
    # glibc only), "release": the C library's default (returned to the OS, faulted in again next step)
    host_memory: str = "retain"
    parallel: str = "none"
    mesh: str | None = None
    # how a distributed run places embedding tables (row/table/column-wise or auto), and the memory
    # budget per device (GiB of state) that auto places by and every plan is checked against
    table_sharding: str | None = None
    hbm_budget_gib: float | None = None
    # multi-process (multi-host) JAX on the TPU path: jax.distributed's coordinator, process count and id
    multihost: bool = False
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            embedding_dim=self.embedding_dim,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            uih_len=self.uih_len,
            num_candidates=self.num_candidates,
            hash_size=self.hash_size,
            input_dropout=self.input_dropout,
            layer_dropout=self.layer_dropout,
        )

    def wants_multihost(self) -> bool:
        """Whether this run joins a multi-process JAX job (any multi-host flag given)."""
        return self.multihost or any(
            v is not None for v in (self.coordinator, self.num_processes, self.process_id)
        )

    def check(self) -> None:
        for key in (
            "num_train_batches",
            "log_every",
            "num_eval_batches",
            "keep_checkpoints",
            "profile_steps",
        ):
            if getattr(self, key) < 1:
                raise config_error(f"--{key} must be >= 1, got {getattr(self, key)}")
        for key in ("num_workers", "eval_every", "checkpoint_every", "num_threads"):
            if getattr(self, key) < 0:
                raise config_error(f"--{key} must be >= 0, got {getattr(self, key)}")
        for key in ("lr", "sparse_lr"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):  # NaN fails both
                raise config_error(f"--{key} must be a finite number > 0, got {value}")
        for key in ("input_dropout", "layer_dropout"):
            if not 0 <= getattr(self, key) < 1:
                raise config_error(f"--{key} must be in [0, 1), got {getattr(self, key)}")
        if self.token_budget is not None and self.token_budget != "auto" and not self.token_budget.isdigit():
            raise config_error(
                f"--token_budget must be a number of tokens or 'auto', got {self.token_budget!r}"
            )
        if self.token_buckets < 1 or (self.token_buckets > 1 and self.token_budget != "auto"):
            raise config_error(
                f"--token_buckets {self.token_buckets} needs a count >= 1, and more than 1 chooses its budgets "
                f"from the data: it takes --token_budget auto (got {self.token_budget}). Fix: add --token_budget "
                "auto, or leave --token_buckets at 1."
            )
        if self.host_memory not in ("retain", "heap", "release"):
            raise config_error(
                f"unknown --host_memory {self.host_memory!r}; expected retain, heap or release"
            )
        for key in ("checkpoint_dir", "tensorboard_dir", "profile"):
            _check_directory(key, getattr(self, key))
        if self.checkpoint_every and not self.checkpoint_dir:
            raise config_error("--checkpoint_every needs --checkpoint_dir")
        from ._config import MATMUL_PRECISIONS, PARALLEL, PRECISIONS, RECOMPUTE, STEP_RECOMPUTE, TABLE_DTYPES

        if self.embedding_backend == "cpu" and self.target != "tpu":
            raise config_error(
                f"--embedding_backend cpu (tables on the host, the rest of the step on the device) is the TPU "
                f"path's (got --target {self.target}). Fix: --target tpu --embedding_backend cpu, or on this "
                "target --embedding_backend in_graph (or leave the flag out for the target's default)."
            )
        if self.embedding_backend == "cpu" and (self.wants_multihost() or self.table_sharding is not None):
            raise config_error(
                "--embedding_backend cpu keeps every table whole in this process's host memory: it takes no "
                "--table_sharding and no --multihost (got --table_sharding "
                f"{self.table_sharding}, --multihost {self.wants_multihost()}). Fix: drop those flags, or use "
                "--embedding_backend in_graph / ring_shift to place tables on the devices."
            )

        if self.precision not in PRECISIONS:
            raise config_error(
                f"unknown --precision {self.precision!r}; expected one of {', '.join(PRECISIONS)}"
            )
        if self.table_dtype not in TABLE_DTYPES:
            raise config_error(
                f"unknown --table_dtype {self.table_dtype!r}; expected one of {', '.join(TABLE_DTYPES)}"
            )
        if self.table_dtype != "fp32" and self.target == "eager":
            raise config_error(
                f"--table_dtype {self.table_dtype} rewrites the captured step; --target eager has none. Fix: "
                "--target gpu, tpu or eager-graph, or --table_dtype fp32."
            )
        if self.table_dtype != "fp32" and self.embedding_backend not in (None, "in_graph"):
            raise config_error(
                f"--table_dtype {self.table_dtype} stores the tables in the step's own state, read by gathers "
                f"in the graph; --embedding_backend {self.embedding_backend} looks them up outside it. Fix: "
                "--embedding_backend in_graph (or leave it unset), or --table_dtype fp32."
            )
        if (
            self.table_dtype != "fp32"
            and self.target in ("gpu", "eager-graph")
            and self.parallel == "fsdp"
            and self.table_sharding is None
        ):
            # measured: the tables were FSDP's, gathered before their lookups, and trained fp32 (only logged)
            raise config_error(
                f"--table_dtype {self.table_dtype} with --parallel fsdp and no --table_sharding: FSDP shards the "
                "tables too and gathers each before its lookups, and the GPU path stores only sharded (row-, "
                "table-, column-wise) or replicated tables in fp16/bf16. Fix: --table_sharding row, table or "
                "column (tables sharded, dense state FSDP), --parallel hybrid, auto or dp, or --table_dtype fp32."
            )
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS:
            raise config_error(
                f"unknown --matmul_precision {self.matmul_precision!r}; expected one of {', '.join(MATMUL_PRECISIONS)} "
                "(torch.set_float32_matmul_precision's settings)"
            )
        if self.recompute not in RECOMPUTE:
            raise config_error(
                f"unknown --recompute {self.recompute!r}; expected one of {', '.join(RECOMPUTE)}"
            )
        if self.recompute in STEP_RECOMPUTE and self.target == "eager":
            raise config_error(
                f"--recompute {self.recompute} rewrites the captured step; --target eager has none. Fix: "
                "--target gpu, tpu or eager-graph, or --recompute none."
            )
        if self.mask_padding and self.target == "eager":
            raise config_error(
                "--mask_padding rewrites the captured step; --target eager has none. Fix: --target gpu, tpu "
                "or eager-graph, or leave --mask_padding out."
            )
        stages = self.pipeline_sparse
        if isinstance(stages, bool) or not isinstance(stages, int) or (stages != 0 and stages < 2):
            raise config_error(
                f"--pipeline_sparse {self.pipeline_sparse!r}: expected 0 (off) or a stage count >= 2 (2: batch "
                "i+1's sparse inputs during batch i's step)."
            )
        if self.pipeline_sparse and (self.target == "eager" or self.token_buckets > 1):
            raise config_error(
                f"--pipeline_sparse rewrites one captured step that sees the next batches: not with --target "
                f"{self.target} or --token_buckets {self.token_buckets}. Fix: --target gpu, tpu or eager-graph "
                "with one token budget, or --pipeline_sparse 0."
            )
        if self.cuda_graphs and (self.target != "gpu" or self.parallel != "none"):
            raise config_error(
                f"--cuda_graphs is the single-process GPU path's flag (got --target {self.target}, --parallel "
                f"{self.parallel}). Fix: --target gpu without --parallel, on a CUDA machine."
            )
        from ._config import COMPILE_REGIONS

        if self.compile_regions not in COMPILE_REGIONS:
            raise config_error(
                f"unknown --compile_regions {self.compile_regions!r}; expected one of {', '.join(COMPILE_REGIONS)}"
            )
        if self.compile_regions not in ("whole", "auto") and self.target != "gpu":
            raise config_error(
                f"--compile_regions {self.compile_regions} is the GPU path's flag (got --target {self.target}). "
                "Fix: --target gpu, or drop the flag."
            )
        if self.attention_kernel not in ("inductor", "triton"):
            raise config_error(
                f"unknown --attention_kernel {self.attention_kernel!r}; expected one of inductor, triton"
            )
        if self.attention_kernel == "triton" and (self.target != "gpu" or self.recompute != "attention"):
            raise config_error(
                f"--attention_kernel triton runs the GPU path's attention op as RecIR's Triton kernels (got "
                f"--target {self.target}, --recompute {self.recompute}); without --recompute attention the "
                "attention is plain ATen in the step, not the op. Fix: --target gpu --recompute attention on a "
                "CUDA machine, or drop --attention_kernel."
            )
        if self.parallel not in PARALLEL:
            raise config_error(f"unknown --parallel {self.parallel!r}; expected one of {', '.join(PARALLEL)}")
        self._check_placement()
        if self.mesh is not None and self.target != "tpu":
            raise config_error(
                f"--mesh is the TPU path's flag (got --target {self.target}). Fix: --target tpu --mesh "
                "data=N, or on the GPU path launch N processes with torchrun --nproc-per-node N --parallel dp."
            )
        if self.wants_multihost():
            if self.target != "tpu" or self.mesh is None:
                raise config_error(
                    "--multihost / --coordinator / --num_processes / --process_id join a multi-process JAX "
                    f"job on the TPU path (got --target {self.target}, --mesh {self.mesh}). Fix: add "
                    "--target tpu --mesh data=N, N the devices of all processes together; on the GPU path "
                    "use torchrun instead."
                )
            if self.num_processes is not None and self.num_processes < 1:
                raise config_error(f"--num_processes must be >= 1, got {self.num_processes}")
        if self.resume == "latest" and not self.checkpoint_dir:
            raise config_error("--resume without a path needs --checkpoint_dir (or pass --resume PATH)")
        if self.overwrite and not self.checkpoint_dir:
            raise config_error("--overwrite needs --checkpoint_dir (whose checkpoints it deletes)")
        if self.overwrite and self.resume is not None:
            raise config_error(
                "--resume and --overwrite contradict each other: --overwrite starts a new run, deleting the "
                f"checkpoints in {self.checkpoint_dir}; --resume continues one. Fix: pass one of them."
            )

    def _check_placement(self) -> None:
        from ._config import TABLE_SHARDINGS

        distributed = (self.target == "tpu" and self.mesh is not None) or (
            self.target in ("gpu", "eager-graph") and self.parallel != "none"
        )
        if self.table_sharding is not None and self.table_sharding not in TABLE_SHARDINGS:
            raise config_error(
                f"unknown --table_sharding {self.table_sharding!r}; expected one of {', '.join(TABLE_SHARDINGS)}"
            )
        if self.hbm_budget_gib is not None and not (
            self.hbm_budget_gib > 0 and math.isfinite(self.hbm_budget_gib)
        ):
            raise config_error(f"--hbm_budget_gib must be a finite number > 0, got {self.hbm_budget_gib}")
        for flag in ("table_sharding", "hbm_budget_gib"):
            if getattr(self, flag) is not None and not distributed:
                raise config_error(
                    f"--{flag} places the tables of a distributed run (got --target {self.target}, --mesh "
                    f"{self.mesh}, --parallel {self.parallel}). Fix: --target tpu --mesh data=N, or on the GPU "
                    "path --parallel hybrid under torchrun --nproc-per-node N."
                )
        if self.embedding_backend == "ring_shift" and self.table_sharding not in ("row", "auto"):
            raise config_error(
                "--embedding_backend ring_shift looks up row-wise sharded tables over a device mesh "
                f"(got --table_sharding {self.table_sharding}). Fix: --target tpu --mesh data=N "
                "--table_sharding row."
            )


def _check_directory(key: str, value: str | None) -> None:
    """--`key` names a directory the run creates or writes into: refuse one that is, or lies under, a
    file before any work (the run would fail at its first write). Reads only."""
    if value is None:
        return
    path = Path(value)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == path else f"lies under the file {part}"
                raise config_error(
                    f"--{key} {value} {what}, not a directory. Fix: pass a directory path (created if missing)."
                )
            return
