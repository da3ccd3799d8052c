"""Model sizes and per-dataset feature layouts (tables, contextual features, tasks) from docs/dlrmv3-reference.md.

A `DatasetSpec` is plain data: it names the embedding tables and which features share them, so the
model, the batch format and every loader agree on one layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """One binary task: label = (candidate action bitmask & weight) > 0."""

    name: str
    weight: int


@dataclass(frozen=True)
class TableSpec:
    """One embedding table; `rows` is the reference size (capped by `--hash_size`)."""

    name: str
    rows: int
    features: tuple[str, ...]


@dataclass(frozen=True)
class DatasetSpec:
    """The feature layout of one dataset."""

    name: str
    uih_feature: str
    item_feature: str
    contextual: tuple[str, ...]
    contextual_min_uih: dict[str, int]
    tables: tuple[TableSpec, ...]
    action_weights: tuple[int, ...]
    tasks: tuple[Task, ...]
    train_fraction: float = 0.75

    @property
    def features(self) -> tuple[str, ...]:
        """KJT key order: UIH ids, candidate ids, then the contextual features."""
        return (self.uih_feature, self.item_feature, *self.contextual)


_M = 10_000_000
_KUAI_RANGES = (
    "user_active_degree",
    "follow_user_num_range",
    "fans_user_num_range",
    "friend_user_num_range",
    "register_days_range",
)
_KUAI_TASKS = ("is_click", "is_like", "is_follow", "is_comment", "is_forward", "is_hate", "long_view")


def _debug_spec(name: str) -> DatasetSpec:
    return DatasetSpec(
        name=name,
        uih_feature="uih_post_id",
        item_feature="item_post_id",
        contextual=("viewer_id", "dummy_contextual"),
        contextual_min_uih={},
        tables=(
            TableSpec("post_id", _M, ("uih_post_id", "item_post_id")),
            TableSpec("viewer_id", _M, ("viewer_id",)),
            TableSpec("dummy_contextual", _M, ("dummy_contextual",)),
        ),
        action_weights=(1, 2, 4, 8, 16),
        tasks=(Task("vvp100", 1),),
    )


def _movielens_spec(name: str) -> DatasetSpec:
    one_m = name == "movielens-1m"
    ctx = ("user_id", "sex", "age_group", "occupation", "zip_code") if one_m else ("user_id",)
    movie_rows = _M if one_m else 1_000_000_000
    user_rows = _M if one_m else 3_000_000
    tables = [TableSpec("movie_id", movie_rows, ("movie_id", "item_movie_id"))]
    tables += [TableSpec(c, user_rows if c == "user_id" else _M, (c,)) for c in ctx]
    return DatasetSpec(
        name=name,
        uih_feature="movie_id",
        item_feature="item_movie_id",
        contextual=ctx,
        contextual_min_uih={c: 20 for c in ctx},
        tables=tuple(tables),
        # rating r sets bit r-1 (the reference's action weights); rating >= 3.5 means bits 8 or 16.
        action_weights=(1, 2, 4, 8, 16),
        tasks=(Task("rating_ge_3.5", 8 | 16),),
        train_fraction=0.75 if one_m else 0.8,
    )


def _kuairand_spec() -> DatasetSpec:
    tasks = tuple(Task(n, 1 << i) for i, n in enumerate(_KUAI_TASKS)) + (Task("is_profile_enter", 128),)
    tables = [
        TableSpec("video_id", _M, ("video_id", "item_video_id")),
        TableSpec("user_id", _M, ("user_id",)),
    ]
    tables += [TableSpec(r, 9, (r,)) for r in _KUAI_RANGES]
    return DatasetSpec(
        name="kuairand-1k",
        uih_feature="video_id",
        item_feature="item_video_id",
        contextual=("user_id", *_KUAI_RANGES),
        contextual_min_uih={},
        tables=tuple(tables),
        action_weights=tuple(1 << i for i in range(8)),
        tasks=tasks,
    )


TARGETS = ("eager", "eager-graph", "gpu", "tpu")
# fp32 everywhere, or bf16 matrix products with fp32 master weights and optimizer state
PRECISIONS = ("fp32", "bf16")
#: --table_dtype: how the embedding tables are stored in training (recir-embed-table-dtype; fp16 is the reference's)
TABLE_DTYPES = ("fp32", "fp16", "bf16")
#: torch.set_float32_matmul_precision's settings (--matmul_precision): how float32 matrix products are computed
MATMUL_PRECISIONS = ("highest", "high", "medium")
#: --recompute: none; layers (every STU layer recomputed in the backward from its input, activation
#: checkpointing); auto (recir-recompute-activations' cost policy: elementwise values and norms recomputed,
#: products kept, across the whole model); attention (the model's own: each STU attention's backward
#: recomputes its scores instead of keeping them, `STULayer.recompute_scores`)
RECOMPUTE = ("none", "layers", "auto", "attention")
#: the --recompute modes that rewrite the captured step (recir-recompute-activations' copies), which
#: --target eager cannot run and --compile_regions auto compiles whole
STEP_RECOMPUTE = ("layers", "auto")
PARALLEL = ("none", "dp", "fsdp", "hybrid", "auto")
#: --compile_regions (GPU path): whole (the step as one Inductor graph), repeated (each STU layer's code
#: compiled once, recir.lower_gpu GPUOptions.regions), auto (repeated from REGIONS_FROM_LAYERS layers on
#: the CPU device, single process: there it compiled in 34.7 s against 49.6 s at full size)
COMPILE_REGIONS = ("auto", "whole", "repeated")
REGIONS_FROM_LAYERS = 4
# --table_sharding: row-, table-, column-wise, or the planner's choice by memory budget
TABLE_SHARDINGS = ("row", "table", "column", "auto")
# cpu: tables on the host (PyTorch's CPU kernels), the rest of the step on the device (--target tpu)
EMBEDDING_BACKENDS = ("fbgemm", "torchrec", "in_graph", "ring_shift", "cpu")
OPTIMIZERS = ("reference", "adam", "adagrad")
DATASETS: tuple[str, ...] = ("debug", "debug-random", "movielens-1m", "movielens-20m", "kuairand-1k")
KUAIRAND_RANGE_FEATURES = _KUAI_RANGES


def dataset_spec(name: str) -> DatasetSpec:
    """The layout of dataset `name` (one of `DATASETS`)."""
    if name in ("debug", "debug-random"):
        return _debug_spec(name)
    if name in ("movielens-1m", "movielens-20m"):
        return _movielens_spec(name)
    if name == "kuairand-1k":
        return _kuairand_spec()
    raise config_error(f"unknown dataset {name!r}: expected one of {', '.join(DATASETS)}")


@dataclass(frozen=True)
class ModelConfig:
    """DLRMv3 sizes. The reference is dim 512, 5 layers, 4 heads; the defaults train fast on a CPU."""

    embedding_dim: int = 64
    num_layers: int = 2
    num_heads: int = 2
    uih_len: int = 32
    num_candidates: int = 4
    hash_size: int = 1000
    input_dropout: float = 0.2
    layer_dropout: float = 0.1
    action_embedding_dim: int = 8
    num_position_buckets: int = 8192
    num_time_buckets: int = 2048

    def __post_init__(self) -> None:
        checks = {
            "embedding_dim": self.embedding_dim,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "uih_len": self.uih_len,
            "num_candidates": self.num_candidates,
            "hash_size": self.hash_size,
        }
        for key, value in checks.items():
            if value < 1:
                raise config_error(f"--{key} must be >= 1, got {value}")
        if self.embedding_dim % self.num_heads:
            raise config_error(
                f"--embedding_dim {self.embedding_dim} must be divisible by --num_heads {self.num_heads}"
            )
        for key, p in (("input_dropout", self.input_dropout), ("layer_dropout", self.layer_dropout)):
            if not 0.0 <= p < 1.0:
                raise config_error(f"--{key} must be in [0, 1), got {p}")

    @property
    def head_dim(self) -> int:
        return self.embedding_dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        """The preprocessor MLP width (256 for the reference's 512)."""
        return max(self.embedding_dim // 2, 1)

    def table_rows(self, table: TableSpec) -> int:
        return min(table.rows, self.hash_size)


def config_error(message: str) -> Any:
    """recir.transforms.ConfigError(message), imported on first use: the CLI's --help imports this module
    and the options module, and recir.transforms imports torch (seconds)."""
    from recir.transforms import ConfigError

    return ConfigError(message)
