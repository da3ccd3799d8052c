"""One trainer interface over the targets: `eager` (torch.optim on the live model), `eager-graph` (capture,
run by the StepGraph interpreter), `gpu` (capture + recir.lower_gpu.compile), `tpu` (recir.lower_tpu).

Every trainer exposes its state as one flat `slot name -> tensor` dict (the StepGraph's names:
`param:*`, `buffer:*`, `optim:*`, `rng:*`), which checkpoints and the parity tool use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol

import recir.distributed as rd
import torch
from recir.capture import load_into, state_from, with_shared_step
from recir.transforms import ConfigError

from ._batch import Batch
from ._config import EMBEDDING_BACKENDS, PRECISIONS, RECOMPUTE, TABLE_DTYPES, TARGETS
from ._model import DLRMv3, loss_fn
from ._released import ReleasedWeights

_RNG = "rng:torch_cpu"
_log = logging.getLogger("recir.dlrmv3")


class Trainer(Protocol):
    model: DLRMv3
    compile_seconds: float
    description: str
    checkpoint_plan: Any  # the plan state_dict()'s shards follow (None: global tensors)

    lookahead: int  # batches step() wants in `upcoming` (a pipelined step's look-ahead; 0: none)

    def step(self, batch: Batch, upcoming: Sequence[Batch] = ()) -> tuple[torch.Tensor, torch.Tensor]: ...
    def state_dict(self) -> dict[str, torch.Tensor]: ...
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None: ...
    def sync_model(self) -> DLRMv3: ...


class EagerTrainer:
    """Trains the live model with torch.optim on `device` (default the CPU; the benchmark passes CUDA
    for an eager baseline on the GPU); dropout draws from that device's global torch generator."""

    def __init__(
        self,
        model: DLRMv3,
        optimizers: list[torch.optim.Optimizer],
        precision: str = "fp32",
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.lookahead = 0  # no pipelined step: step() ignores `upcoming`
        # Module.to moves each parameter's data in place, so the optimizers' references stay valid.
        self.model, self.optimizers = model.to(self.device), optimizers
        for opt in optimizers:  # state made at construction (RowWiseAdagrad's sums) follows the params;
            for per_param in opt.state.values():  # 0-dim counters stay where torch.optim wants them
                for k, v in per_param.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        per_param[k] = v.to(self.device)
        self.compile_seconds = 0.0
        self.checkpoint_plan = None
        self.description = f"eager PyTorch on {self.device.type.upper()} (nothing to compile)"
        # bf16: torch.autocast, what an eager user runs (bf16 matrix products, fp32 weights)
        self.autocast = precision == "bf16"
        self.loss_fn = loss_fn  # replaceable, e.g. by torch.compile(loss_fn) in benchmarks/dlrmv3.py

    def step(self, batch: Batch, upcoming: Sequence[Batch] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.train()
        if self.device.type != "cpu":
            batch = batch.to(self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss, logits = self.loss_fn(self.model, batch)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in self.optimizers:
            opt.step()
        return loss.detach(), logits.detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = state_from(self.model, self.optimizers)
        state[_RNG] = torch.get_rng_state()
        return {k: v.cpu() for k, v in state.items()} if self.device.type != "cpu" else state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        load_into(self.model, self.optimizers, state)
        if _RNG in state:
            torch.set_rng_state(state[_RNG])

    def sync_model(self) -> DLRMv3:
        return self.model


def engine(target: str) -> ModuleType:
    """The lowering package of ``target`` (``recir.lower_gpu`` or ``recir.lower_tpu``), imported here rather
    than with this package: recir.lower_tpu loads JAX and torchax, which `--help` and the eager target do
    not need. A missing one is a ConfigError saying how to install it."""
    if target not in ("gpu", "tpu"):
        raise ConfigError(f"unknown --target {target!r}; expected one of {', '.join(TARGETS)}")
    try:
        if target == "gpu":
            import recir.lower_gpu

            return recir.lower_gpu
        import recir.lower_tpu

        return recir.lower_tpu
    except ImportError as e:
        raise ConfigError(
            f"--target {target} needs recir.lower_{target}, which failed to import ({e}). "
            "Fix: install the workspace with `uv sync`, or use --target eager."
        ) from None


def _device_words(target: str) -> str:
    if target == "gpu":
        return "CUDA" if torch.cuda.is_available() else "the CPU (no CUDA device: Inductor's C++ backend)"
    import jax

    backend = jax.default_backend()
    return "TPU" if backend == "tpu" else f"JAX's {backend.upper()} backend (no TPU)"


class CompiledTrainer:
    """capture_train_step + the target's backend; the state lives in the backend between steps.

    One class for every captured target: the StepGraph interpreter (`eager-graph`), recir.lower_gpu
    (`gpu`), recir.lower_tpu (`tpu`). With `parallel` other than `none` on the GPU path it trains this
    rank's recir.distributed program (torchrun's process group, or a one-process group); with `mesh` on
    the TPU path, a global-batch plan that GSPMD partitions over the mesh.
    """

    def __init__(
        self,
        model: DLRMv3,
        optimizers: list[torch.optim.Optimizer],
        example: Batch,
        target: str,
        embedding_backend: str | None,
        mesh: Any = None,
        parallel: str = "none",
        precision: str = "fp32",
        compile_options: Any = None,
        table_sharding: str | None = None,
        hbm_budget_gib: float | None = None,
        recompute: str = "none",
        state: Any = None,
        pipeline_sparse: int = 0,
        mask_padding: bool = False,
        table_dtype: str = "fp32",
    ) -> None:
        """`state`: another trainer's (same slots) to continue from instead of the model's.
        `pipeline_sparse` >= 2: recir-pipeline-sparse with that many stages; :meth:`step` then also takes
        the next `lookahead` batches (the pipelined step computes their sparse inputs ahead)."""
        from recir.capture import capture_train_step
        from recir.embedding import overrides

        from ._parallel import DEFAULT_MESH_AXIS, describe_plan, plan_step

        lowering = None if target == "eager-graph" else engine(target)
        if embedding_backend is not None and embedding_backend not in EMBEDDING_BACKENDS:
            raise ConfigError(
                f"unknown --embedding_backend {embedding_backend!r}; expected one of {', '.join(EMBEDDING_BACKENDS)}"
            )
        # capture takes the list (dense Adam + RowWiseAdagrad tables). recir::check_jagged (ids and
        # lengths, DataError) stays in the graph on the GPU path; recir.lower_tpu.compile takes it out
        # of the graph and runs it on the host before each step (TPUOptions.host_checks).
        self.model, self.optimizers = model, list(optimizers)
        opt: Any = self.optimizers[0] if len(self.optimizers) == 1 else self.optimizers
        model.train()
        started = time.perf_counter()
        # the GPU path's sharded tables (recir-dist-shard-tables) are stored fp16/bf16 on each rank's program,
        # after distribute: the global step's low-precision form (lookups widened, an fp32 copy for the
        # dense update) is no sharded lookup
        shard_then_store = mesh is None and parallel not in ("none", "dp") and table_dtype != "fp32"
        rewrites = step_pipeline(
            precision, recompute, mask_padding, "fp32" if shard_then_store else table_dtype
        )
        if table_dtype != "fp32" and embedding_backend is None:  # the tables are read by gathers in the graph
            embedding_backend = "in_graph"
        self.graph = rewrites.run(capture_train_step(model, opt, loss_fn, example, overrides=overrides()))
        self.plan: Any = None  # the recir.distributed plan of a distributed run
        self.checkpoint_plan = None  # the plan state_dict()'s shards follow (None: global tensors)
        self.dstep: Any = None  # this rank's program (GPU path, --parallel)
        program: Any = self.graph
        where = ""
        if mesh is not None:  # the TPU path: a global-batch plan, GSPMD partitions the step over the mesh
            self.plan = plan_step(self.graph, mesh, parallel, table_sharding, hbm_budget_gib, batch="global")
            import jax

            where = f", mesh {mesh.axes} over {jax.process_count()} process(es), parallel {parallel} ({self.plan.mode})"
        elif parallel != "none":  # the GPU path: one process per device, this rank's program
            rank, world = rd.setup_process_group()
            mesh = rd.Mesh(axes={DEFAULT_MESH_AXIS: world})
            self.plan = plan_step(self.graph, mesh, parallel, table_sharding, hbm_budget_gib, batch="local")
            self.checkpoint_plan = self.plan
            program = self.dstep = rd.distribute(self.graph, self.plan, rank)
            if shard_then_store:
                local = step_pipeline(
                    "fp32", table_dtype=table_dtype, shards=_shard_elements(self.plan, rank)
                )
                program = self.dstep = local.run(program)
                rewrites.records.extend(local.records)
            backend = torch.distributed.get_backend()
            where = f", {world} rank(s), parallel {parallel} ({self.plan.mode}), {backend} process group"
        recomputed = (  # the rewrites' reports, a sharded run's table dtype included
            "".join(
                f", --recompute {recompute}: {r.stats['regions']} region(s), interpreter peak "
                f"{r.stats['peak_bytes_before'] / 2**20:.0f} -> {r.stats['peak_bytes_after'] / 2**20:.0f} MiB"
                for r in rewrites.records
                if r.name == "recir-recompute-activations"
            )
            + "".join(
                f", --table_dtype {table_dtype}: {len(r.stats['tables'])} table(s), "
                f"{r.stats['bytes_saved'] / 2**20:.1f} MiB saved"
                + (f", kept fp32: {r.stats['skipped']}" if r.stats["skipped"] else "")
                for r in rewrites.records
                if r.name == "recir-embed-table-dtype"
            )
            + "".join(
                f", --mask_padding: {r.stats['features']} jagged feature(s), {r.stats['masked']} lookup(s) masked"
                + ("" if r.stats["masked"] else " (the KJT path already masks its padding)")
                for r in rewrites.records
                if r.name == "recir-embed-mask-padding"
            )
        )
        where += recomputed
        self.plan_lines = describe_plan(self.plan) if self.plan is not None else []
        self.capture_seconds = time.perf_counter() - started
        self.lookahead = max(pipeline_sparse - 1, 0)  # batches step() wants beyond the one it trains
        self._filled = False  # whether the carries hold the batches step() is given next
        if lowering is None:
            self.compiled: Any = program  # a StepGraph is a CompiledStep run by its interpreter
            self.description = f"the captured StepGraph's reference interpreter (no compile){where}"
        else:
            extra: dict[str, Any] = {} if compile_options is None else {"options": compile_options}
            if target == "tpu":
                extra["mesh"] = mesh
            elif pipeline_sparse:
                # FBGEMM's fused TBE trains its tables outside the graph, in each compiled step's own module;
                # the pipelined step and its prologue share one state, so their tables stay in the graph
                base = extra.get("options") or lowering.GPUOptions()
                extra["options"] = dataclasses.replace(base, fused_tbe=False)

            def lower(step: Any) -> Any:
                # identical programs on every rank compile once per machine (a no-op without a process group)
                with contextlib.nullcontext() if target == "tpu" else lowering.compile_in_turn(step):
                    return lowering.compile(step, self.plan, embedding_backend=embedding_backend, **extra)

            self.compiled = None if pipeline_sparse else lower(program)
            self.description = (
                f"{lowering.__name__}.compile on {_device_words(target)}{where}, "
                f"embedding backend {embedding_backend or 'default'}"
            )
            if (
                tbe := getattr(self.compiled, "tbe", None)
            ) is not None:  # recir.lower_gpu's FusedTBECompiledStep
                self.description += (
                    f" ({len(tbe.split.tables)} table(s) trained by FBGEMM's TBE, fused optimizer)"
                )
        if pipeline_sparse:
            from recir.transforms import PipelinedStep

            pipe = PipelinedStep.build(program, pipeline_sparse, None if lowering is None else lower)
            self.compiled = pipe
            stats = pipe.stats
            self.description += (
                f", --pipeline_sparse {pipeline_sparse}: {stats['moved']} node(s) ahead ({stats['collectives']} "
                f"collective(s)), {stats['carried']} value(s) carried ({stats['carry_bytes'] / 1024:.1f} KiB)"
            )
        # the TPU path on one device: JAX holds the weights, the model's copy is released (see _released),
        # each parameter as soon as its copy exists
        self.released = self._released_weights() if target == "tpu" and mesh is None else None
        if state is not None:
            self.state = state
            if self._shares_model():  # a later budget's trainer: the tables the first one released
                self.released = self._unshared_weights()
        elif self._shares_model():  # the GPU path: one copy of the weights, trained in place
            self.released = self._unshared_weights()  # --table_dtype's tables: dropped as they are converted
            release = None if self.released is None else self.released.release_slot
            self.state = self.compiled.init_state(model, opt, share_model=True, release=release)
        elif self.released is not None:
            self.state = self.compiled.init_state(model, opt, release=self.released.release_slot)
        else:
            self.state = self.compiled.init_state(model, opt)
        if self.released is not None:
            self.released.release()
            if target == "gpu":
                # glibc keeps the freed float32 tables resident otherwise (full size: 0.6 GiB); the TPU
                # lowering trims after building its state itself
                from recir.embedding import trim_host_heap

                trim_host_heap()
        self._first = True
        self.compile_seconds = 0.0

    def _released_weights(self) -> ReleasedWeights | None:
        """The model's parameters to release when the state holds them as single-device JAX arrays (a plain
        recir.lower_tpu step: not pipelined, not split between host and device)."""
        from recir.lower_tpu import TPUCompiledStep

        if not isinstance(self.compiled, TPUCompiledStep):
            return None
        return ReleasedWeights(self.model, (slot.name for slot in self.compiled.step.signature.state))

    def _unshared_weights(self) -> ReleasedWeights | None:
        """The GPU path's parameters the state holds in another dtype than the model's (``--table_dtype``'s
        tables): released, so the process does not keep the model's float32 tables beside the state's
        copy; `sync_model()` shows them again."""
        from recir.transforms import param_slot

        dtypes = {slot.name: slot.dtype for slot in self.compiled.step.signature.state}
        params = self.model.named_parameters()
        other = [param_slot(n) for n, p in params if dtypes.get(param_slot(n), p.dtype) != p.dtype]
        return ReleasedWeights(self.model, other) if other else None

    def _shares_model(self) -> bool:
        """Whether the step trains the model's own tensors: a step that updates its state in place (the GPU
        path) and can take them as its state (``init_state(share_model=True)``), not distributed. Then the
        process keeps one copy of the weights, not the model's plus the step's (full-size DLRMv3: 0.7 GiB of
        tables and dense weights), and the model always shows the trained values."""
        init = getattr(self.compiled, "init_state", None)
        return bool(
            getattr(self.compiled, "in_place", False)
            and self.dstep is None
            and init is not None
            and "share_model" in inspect.signature(init).parameters
        )

    def _share_with_model(self) -> None:
        """After a load (which copies): the model's parameters and buffers become the new state tensors
        again, where shape, dtype and device match."""
        if not self._shares_model():
            return
        from recir.transforms import buffer_slot, param_slot

        live = self.compiled.state_dict(self.state)
        for slot_of, named in (
            (param_slot, self.model.named_parameters()),
            (buffer_slot, self.model.named_buffers()),
        ):
            for name, t in named:
                s = live.get(slot_of(name))
                if isinstance(s, torch.Tensor) and (s.shape, s.dtype, s.device) == (
                    t.shape,
                    t.dtype,
                    t.device,
                ):
                    t.data = s

    def step(self, batch: Batch, upcoming: Sequence[Batch] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Train on `batch`. Pipelined (`lookahead` > 0): `upcoming` are the batches the next calls get
        (up to `lookahead`; fewer at the end, when the last one is repeated as a look-ahead)."""
        started = time.perf_counter()
        if self.released is not None and self.released.showing:  # drop sync_model's views: donate in place
            self.released.release()
        if self.lookahead:
            outputs = self._pipelined_step(batch, list(upcoming)[: self.lookahead])
        else:
            self.state, outputs = self.compiled(self.state, batch)
        if self._first:
            self._first = False
            self.compile_seconds = self.capture_seconds + float(
                self.compiled.compile_seconds or time.perf_counter() - started
            )
        loss, logits = outputs[0], outputs[1]
        return torch.as_tensor(loss).detach(), torch.as_tensor(logits).detach()

    def _pipelined_step(self, batch: Batch, upcoming: list[Batch]) -> Any:
        """recir-pipeline-sparse: fill the carries (prologue) unless they hold `batch` and the batches after
        it already, then one steady step trains `batch` while computing the last look-ahead's carry."""
        pipe = self.compiled
        ahead = upcoming + [upcoming[-1] if upcoming else batch] * (self.lookahead - len(upcoming))
        if not self._filled:
            for b in [batch, *ahead[:-1]]:
                self.state, _ = pipe.prologue(self.state, b)
        self.state, outputs = pipe.steady(self.state, ahead[-1])
        self._filled = len(upcoming) == self.lookahead  # a short look-ahead left repeats in the carries
        return outputs

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every slot by name: global tensors, or this rank's shards under `checkpoint_plan`. A pipelined
        step's `carry:*` slots (the next batches' sparse inputs) are not training state: left out."""
        return {
            k: torch.as_tensor(v).detach().cpu()
            for k, v in self.compiled.state_dict(self.state).items()
            if not k.startswith("carry:")
        }

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        merged = self.state_dict()  # slots the checkpoint lacks (e.g. another path's RNG) keep their values
        merged.update(with_shared_step(state))
        self.state = self.compiled.load_state_dict(merged)  # a pipelined step's carries: zeros, refilled
        self._share_with_model()
        if self.released is not None:
            self.released.release()  # views of the replaced state would keep it alive
        self._filled = False

    def sync_model(self) -> DLRMv3:
        """The trained state in the live model (a distributed run gathers it: every rank calls this). On the
        one-device TPU path the parameters become views of the trained JAX arrays (no copy) until the next
        step, which releases them again; so do the GPU path's `--table_dtype` tables (converted copies)."""
        if self.released is not None:
            names = (slot.name for slot in self.compiled.step.signature.state)
            self.released.show(dict(zip(names, self.state)))
            return self.model
        state = self.state_dict()
        if self.dstep is not None:
            state = rd.gather_state(
                self.plan, self.dstep, [state[s.name] for s in self.dstep.signature.state]
            )
        load_into(self.model, (), state)
        return self.model


class BucketedTrainer:
    """One CompiledTrainer per token budget (`Data.token_buckets`), captured and compiled when a batch
    of that budget first comes, all continuing one state: each batch runs the step of its own row
    count. Everything else (state_dict, plan, description) is the first budget's trainer's."""

    def __init__(
        self,
        first: CompiledTrainer,
        rows: int,
        make: Callable[[Batch, Any], CompiledTrainer],
        num_budgets: int,
    ) -> None:
        self.first, self._make, self.num_budgets = first, make, num_budgets
        self.by_rows: dict[int, CompiledTrainer] = {rows: first}
        self.compiles_seconds: list[float] = []  # of the later budgets, each on its first batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["first"], name)

    def step(self, batch: Batch, upcoming: Sequence[Batch] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        current = self._current()
        trainer = self.by_rows.get(_rows(batch))
        if trainer is None:
            started = time.perf_counter()
            trainer = self.by_rows[_rows(batch)] = self._make(batch, current.state)
            out = trainer.step(batch)
            self.compiles_seconds.append(time.perf_counter() - started)
            _log.info(
                "token budget %d rows: step captured and compiled in %.2fs (%d of %d budgets)",
                _rows(batch), self.compiles_seconds[-1], len(self.by_rows), self.num_budgets,
            )  # fmt: skip
        else:
            trainer.state = current.state
            out = trainer.step(batch)
        if trainer is not current:
            current.state = None  # one live state: the last trainer's
            self._last = trainer
        return out

    def _current(self) -> CompiledTrainer:
        return self.__dict__.get("_last", self.first)

    @property
    def state(self) -> Any:
        return self._current().state

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._current().state_dict()

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        self._current().load_state_dict(state)

    def sync_model(self) -> DLRMv3:
        return self._current().sync_model()


def _rows(batch: Batch) -> int:
    return int(batch.token_index.shape[0])


def _shard_elements(plan: Any, rank: int) -> tuple[tuple[str, int, int, int], ...]:
    """Where each of ``rank``'s table shards lies in its table (first row, first column, the table's width;
    recir.distributed.shard_range's slice), for recir-embed-table-dtype's ``elements``."""
    out = []
    for table in plan.tables:
        shape = plan.shapes[table]
        dim, start, _ = rd.shard_range(shape, plan.sharding(table), rank)
        out.append((table, start if dim == 0 else 0, start if dim == 1 else 0, int(shape[1])))
    return tuple(out)


def step_pipeline(
    precision: str,
    recompute: str = "none",
    mask_padding: bool = False,
    table_dtype: str = "fp32",
    shards: tuple[tuple[str, int, int, int], ...] = (),
) -> Any:
    """The StepGraph rewrites `--mask_padding`, `--precision`, `--table_dtype` and `--recompute` ask for:
    padded positions of jagged id features zeroed in their unpooled lookups (recir-embed-mask-padding); bf16
    matrix products (fp32 master weights and optimizer state) for bf16; the tables stored fp16/bf16
    (recir-embed-table-dtype); the STU layers' activations recomputed in the
    backward (`layers`), or the cheap values of every module (`auto`). `attention` is the model's own
    (`DLRMv3.recompute_attention_scores`): no rewrite here. ``shards``: the tables that are shards of a rank's
    program (`_shard_elements`), rounded with the whole tables' random bits."""
    from recir.embedding import MaskPadding, TableDtype
    from recir.transforms import MixedPrecision, Pipeline, Recompute

    if precision not in PRECISIONS:
        raise ConfigError(f"unknown --precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    if recompute not in RECOMPUTE:
        raise ConfigError(f"unknown --recompute {recompute!r}; expected one of {', '.join(RECOMPUTE)}")
    transforms: list[Any] = [MaskPadding()] if mask_padding else []
    if table_dtype not in TABLE_DTYPES:
        raise ConfigError(f"unknown --table_dtype {table_dtype!r}; expected one of {', '.join(TABLE_DTYPES)}")
    if precision == "bf16":
        transforms.append(MixedPrecision(compute_dtype="bfloat16"))
    if table_dtype != "fp32":
        transforms.append(TableDtype(dtype=table_dtype, elements=shards))
    if recompute == "layers":
        transforms.append(Recompute(policy="regions", modules=("layers.*",)))
    elif recompute == "auto":
        transforms.append(Recompute(policy="cost"))
    return Pipeline(transforms, name="step")


def check_parallel(target: str, parallel: str, has_mesh: bool) -> None:
    """Refuses a --parallel / --mesh that `target` cannot run (a ConfigError naming the fix)."""
    if target == "eager" and (parallel != "none" or has_mesh):
        raise ConfigError(
            "--parallel / --mesh need the captured step. Fix: --target eager-graph (interpreted), "
            "--target gpu (torchrun) or --target tpu --mesh data=N."
        )
    if target == "tpu" and parallel != "none" and not has_mesh:
        raise ConfigError("--target tpu --parallel needs --mesh (e.g. --mesh data=8): GSPMD splits the step")


def make_trainer(
    target: str,
    model: DLRMv3,
    optimizers: list[torch.optim.Optimizer],
    example: Batch,
    embedding_backend: str | None = None,
    parallel: str = "none",
    mesh: Any = None,
    precision: str = "fp32",
    device: torch.device | str = "cpu",
    compile_options: Any = None,
    table_sharding: str | None = None,
    hbm_budget_gib: float | None = None,
    recompute: str = "none",
    token_buckets: Sequence[int] = (),
    pipeline_sparse: int = 0,
    mask_padding: bool = False,
    table_dtype: str = "fp32",
) -> Trainer:
    """`eager`, or the captured step on `target` (CompiledTrainer: `parallel` other than `none` on the GPU
    path trains this rank's program, `example` then this rank's batch). `device` places the eager trainer
    only; `compile_options` (e.g. recir.lower_gpu.GPUOptions) go to the lowering's compile(). Two or
    more `token_buckets` (`Data.token_buckets`; `example` packed into one of them): a BucketedTrainer."""
    check_parallel(target, parallel, mesh is not None)
    if target == "eager":
        return EagerTrainer(model, optimizers, precision, device)
    parallel = "dp" if mesh is not None and parallel == "none" else parallel  # a mesh alone: data parallel
    args = (embedding_backend, mesh, parallel, precision, compile_options, table_sharding, hbm_budget_gib)
    first = CompiledTrainer(
        model,
        optimizers,
        example,
        target,
        *args,
        recompute=recompute,
        pipeline_sparse=pipeline_sparse,
        mask_padding=mask_padding,
        table_dtype=table_dtype,
    )
    if len(token_buckets) < 2:
        return first

    where = example.token_index.device  # capture sees the model's device (a CUDA run feeds CUDA batches)

    def make(batch: Batch, state: Any) -> CompiledTrainer:
        return CompiledTrainer(
            model,
            optimizers,
            batch.to(where),
            target,
            *args,
            recompute=recompute,
            state=state,
            mask_padding=mask_padding,
            table_dtype=table_dtype,
        )

    return BucketedTrainer(first, _rows(example), make, len(token_buckets))
