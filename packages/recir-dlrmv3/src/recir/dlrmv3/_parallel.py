"""`--parallel` / `--mesh`: one process per device under torchrun (GPU path: gloo on CPU, NCCL on CUDA)
running this rank's recir.distributed program, and the TPU path's global-batch plan over a JAX mesh.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from recir.transforms import ConfigError

from ._batch import Batch
from ._data import Data
from ._model import DLRMv3, loss_fn

DEFAULT_MESH_AXIS = "data"


def parallel_mode(name: str, table_sharding: str | None = None) -> Any:
    """The recir.distributed mode of `--parallel NAME [--table_sharding S]`.

    Without `--table_sharding`, hybrid means data-parallel dense and table-wise tables. With it, `row`,
    `table` or `column` shards the tables that way next to data-parallel dense state (FSDP under
    `--parallel fsdp`), and `auto` is the planner's placement by memory budget (dense replicated).
    """
    import recir.distributed as rd

    modes = {
        "dp": rd.DataParallel(),
        "fsdp": rd.FullyShardedDataParallel(),
        "hybrid": rd.HybridParallel(tables=rd.table_wise()),
        "auto": "auto",
    }
    if name not in modes:
        raise ConfigError(f"unknown --parallel {name!r}; expected one of none, {', '.join(modes)}")
    if table_sharding is None:
        return modes[name]
    from ._config import TABLE_SHARDINGS

    if table_sharding not in TABLE_SHARDINGS:
        raise ConfigError(
            f"unknown --table_sharding {table_sharding!r}; expected one of {', '.join(TABLE_SHARDINGS)}"
        )
    if table_sharding == "auto" or name == "auto":
        if name not in ("dp", "hybrid", "auto") or table_sharding not in ("auto", None):
            raise ConfigError(
                f"--parallel {name} --table_sharding {table_sharding}: the automatic placement keeps dense "
                "state replicated and chooses each table's placement itself. Fix: --table_sharding auto "
                "(with --parallel dp, hybrid or auto), or a fixed --table_sharding row|table|column."
            )
        return "auto"
    tables = {"row": rd.row_wise, "table": rd.table_wise, "column": rd.column_wise}[table_sharding]()
    dense = rd.FullyShardedDataParallel() if name == "fsdp" else rd.DataParallel()
    return rd.HybridParallel(tables=tables, dense=dense)


def plan_step(
    graph: Any,
    mesh: Any,
    parallel: str,
    table_sharding: str | None,
    hbm_budget_gib: float | None,
    batch: Literal["local", "global"],
) -> Any:
    """The recir.distributed plan of a captured step for these flags (`--hbm_budget_gib`: per device)."""
    import recir.distributed as rd

    budget = None if hbm_budget_gib is None else int(hbm_budget_gib * 2**30)
    return rd.plan(graph, parallel_mode(parallel, table_sharding), mesh, memory_budget=budget, batch=batch)


def describe_plan(plan: Any) -> list[str]:
    """Log lines: the tables' placements and the planner's reasons (traffic of each choice included)."""
    placed = ", ".join(f"{t} {plan.slots[t].get('scheme', 'replicated')}" for t in plan.tables)
    lines = [f"plan {plan.mode}: tables {placed or 'none'}"]
    return lines + [f"plan: {e}" for e in plan.explanation]


def parse_mesh(text: str) -> Any:
    """`data=8` or `data=2,model=2` as a recir.distributed Mesh."""
    import recir.distributed as rd

    axes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.strip().partition("=")
        if not eq or not size.strip().isdigit() or int(size) < 1:
            raise ConfigError(
                f"--mesh {text!r}: expected NAME=SIZE[,NAME=SIZE], SIZE >= 1, e.g. --mesh data=8"
            )
        axes[name.strip()] = int(size)
    return rd.Mesh(axes=axes)


def init_process_group() -> tuple[int, int]:
    """(rank, world size): torchrun's group (NCCL on CUDA, gloo on CPU), or a 1-process gloo group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend)
        else:  # launched without torchrun: a one-process group
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def check_batch_split(batch_size: int, data_size: int) -> None:
    if batch_size % data_size:
        lo = batch_size // data_size * data_size or data_size
        raise ConfigError(
            f"--batch_size {batch_size} (the global batch) does not split over the data-parallel size "
            f"{data_size}. Fix: use a multiple of {data_size}, e.g. --batch_size {lo} or "
            f"--batch_size {lo + data_size}."
        )


@contextlib.contextmanager
def _compile_in_turn(dstep: Any) -> Iterator[None]:
    """When every rank lowers the same program (data parallel), each machine's local rank 0 compiles
    first and the others then read its artifacts from the shared compile cache, instead of every rank
    compiling the same graph at once on the same cores. Different programs compile concurrently."""
    import torch.distributed as dist

    text = dstep.graph_module.code + repr([(s.name, s.shape, s.dtype) for s in dstep.signature.state])
    key = hashlib.sha256(text.encode()).hexdigest()
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    if len(set(keys)) > 1:
        yield
        return
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    if not first:
        dist.barrier()  # until every machine's first rank has filled its cache
    yield
    if first:
        dist.barrier()


def local_batch(data: Data, step: int, rank: int, world: int) -> Batch:
    """Rank `rank`'s contiguous slice of global train step `step`'s samples (the global batch split),
    its loss normalised by the global batch's candidate count (`Batch.loss_norm`)."""
    samples = [data.train[i] for i in data.train_indices(step)]
    n = len(samples) // world
    return data._collate(samples[rank * n : (rank + 1) * n], global_samples=samples)


class DistributedTrainer:
    """This rank's recir.distributed program of the captured step: interpreted (`eager-graph`) or
    compiled by recir.lower_gpu (`gpu`). Batches are this rank's local slice; the loss is the global mean.
    """

    def __init__(
        self,
        model: DLRMv3,
        optimizers: list[torch.optim.Optimizer],
        example: Batch,
        target: str,
        embedding_backend: str | None,
        mode: str,
        precision: str = "fp32",
        table_sharding: str | None = None,
        hbm_budget_gib: float | None = None,
    ) -> None:
        import recir.distributed as rd
        from recir.capture import capture_train_step
        from recir.embedding import overrides

        self.rank, self.world = init_process_group()
        self.model = model
        opt: Any = optimizers[0] if len(optimizers) == 1 else list(optimizers)
        model.train()
        started = time.perf_counter()
        from ._trainers import precision_pipeline

        graph = precision_pipeline(precision).run(
            capture_train_step(model, opt, loss_fn, example, overrides=overrides())
        )
        mesh = rd.Mesh(axes={DEFAULT_MESH_AXIS: self.world})
        self.plan = plan_step(graph, mesh, mode, table_sharding, hbm_budget_gib, batch="local")
        self.plan_lines = describe_plan(self.plan)
        self.checkpoint_plan = self.plan
        self.dstep = rd.distribute(graph, self.plan, self.rank)
        self.capture_seconds = time.perf_counter() - started
        if target == "gpu":
            from recir.lower_gpu import compile as lower

            with _compile_in_turn(self.dstep):
                self.program: Any = lower(self.dstep, self.plan, embedding_backend=embedding_backend)
            where = "recir.lower_gpu.compile"
        else:
            self.program = self.dstep
            where = "the StepGraph interpreter"
        self.state = self.program.init_state(model, opt)
        self._first, self.compile_seconds = True, 0.0
        self.description = (
            f"{where}, {self.world} rank(s), parallel {mode} ({self.plan.mode}), "
            f"{torch.distributed.get_backend()} process group"
        )

    def step(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        self.state, outputs = self.program(self.state, batch)
        if self._first:
            self._first = False
            compiled = getattr(self.program, "compile_seconds", None)
            self.compile_seconds = self.capture_seconds + float(compiled or time.perf_counter() - started)
        return torch.as_tensor(outputs[0]).detach(), torch.as_tensor(outputs[1]).detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards by slot name (save them with the plan: `save_checkpoint(..., plan)`)."""
        return {k: torch.as_tensor(v).detach().cpu() for k, v in self.program.state_dict(self.state).items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """This rank's shards (slots the mapping lacks keep their current values)."""
        from recir.capture import with_shared_step

        merged = self.state_dict()
        merged.update(with_shared_step(state))
        self.state = self.program.load_state_dict(merged)

    def sync_model(self) -> DLRMv3:
        """Gathers the global state (collective: every rank calls it) into the live model."""
        import recir.distributed as rd
        from recir.capture import load_into

        local = self.state_dict()
        full = rd.gather_state(self.plan, self.dstep, [local[s.name] for s in self.dstep.signature.state])
        load_into(self.model, (), full)
        return self.model
