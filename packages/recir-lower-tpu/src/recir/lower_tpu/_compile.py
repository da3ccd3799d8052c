"""``compile(step)``: a StepGraph as one ``jax.jit`` program (torchax tracing, donated state).

State lives on the JAX devices between steps; batches arrive and outputs leave as torch tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import jax
import torch
from recir.distributed import ShardingPlan, as_plan
from recir.embedding import (
    HUGE_PAGES_MIN_BYTES,
    CutHostSplit,
    HostEmbeddings,
    advise_large_buffers,
    embedding_report,
    make_heap_room,
    resolve_backend,
    trim_host_heap,
)
from recir.transforms import ConfigError, DataError, Pipeline, StepGraph, verify, verify_level
from torch import nn

from . import _host_checks, _hstu, _lowerings, _ring_shift  # noqa: F401 - register RecIR's built-in lowerings
from ._cache import cache_hits, compile_cache
from ._convert import check_state_count, jax_dtype, to_jax, to_torch
from ._host_checks import HostCheck, host_checks_of
from ._host_split import HostSplitCompiledStep
from ._hstu import ATTENTION_KERNELS
from ._multihost import gather_to_every_process
from ._pipeline import tpu_pipeline
from ._placement import Placement
from ._private_apis import check_private_apis
from ._sharding import placement_for
from ._trace import check_lowerings, jax_step_fn, recir_env

logger = logging.getLogger("recir.lower_tpu")


#: XLA:CPU places a call's temporaries in one block; at least this large, each call first checks that the
#: C heap has a free chunk for it (``recir.embedding.make_heap_room``), else trims the heap's free pages. Under
#: ``retain_host_memory`` (no trim, no mmap) such a block, freed and then split by small allocations, no
#: longer fits where it was, and the heap grew by it again: full-size DLRMv3 at UIH 256 with four token
#: budgets (blocks up to about 1 GiB) peaked at 3.70 instead of 2.87 GiB in 4 of 17 runs, and at UIH 64
#: (blocks of 190-210 MiB) at 2.36 instead of 2.17 GiB in most runs (2026-12-07).
_HEAP_ROOM_MIN_BYTES = 64 << 20


def _host_temp_bytes(compiled: Any) -> int:
    """The temporaries of one call of ``compiled`` in host memory: XLA's memory analysis on the CPU
    backend, 0 elsewhere (a TPU's temporaries live in its HBM) or where the analysis is unavailable."""
    if jax.default_backend() != "cpu":
        return 0
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - an optional analysis; without it nothing is checked
        return 0
    return int(getattr(stats, "temp_size_in_bytes", 0) or 0)


@dataclasses.dataclass(frozen=True)
class TPUOptions:
    """Options of the TPU lowering.

    ``x64``: trace and run with JAX's 64-bit types, so int64/float64 behave exactly as in ATen. ``None``
    (the default) decides per graph: on when the step needs 64-bit integer maths (``rng`` state slots,
    whose step key is int64 maths, or integer constants beyond int32), else off, since TPUs emulate
    64-bit types and ids, offsets and counters fit int32. State and outputs keep their torch dtypes at
    the boundary either way; without x64 an int64 batch or state value outside int32 raises DataError
    before the step or the state's copy (it would wrap). ``persistent_cache``: use JAX's on-disk
    compilation cache in ``cache_dir`` (default ``$RECIR_CACHE_DIR/jax``). ``donate_state``: let XLA
    reuse the state buffers in place.
    ``sparse_updates``: recir-embedding's row-wise table updates (cost grows with the ids in a batch;
    lazy for Adam and touched-rows-only weight decay, so not bit-for-bit torch.optim for tables).
    ``host_checks``: run the step's id/length checks (``recir::check_jagged``, which XLA cannot raise
    from) on the host before each step, so an out-of-range id, a negative length or a length past its
    capacity raises DataError before the device runs; ``False`` skips them (trusted input pipelines).
    ``huge_pages_min_bytes``: on JAX's CPU backend, back every state buffer of at least this many bytes (the
    large embedding tables) by transparent huge pages (Linux; ``recir.embedding.advise_huge_pages``) when
    ``init_state``/``load_state_dict`` build the state; the donated buffers keep them from step to step, and
    a row lookup or update stops paying a TLB miss per id. Default 256 MiB; ``None``: never.
    ``attention_kernel``: how ``recir::hstu_attention`` (HSTU's target-aware attention) runs: ``blocked``
    (a blocked JAX formulation, query row blocks against only the keys they see) or ``pallas`` (its
    forward and its backward as Pallas kernels that skip padded history keys and padded query rows;
    Pallas's interpreter off a TPU, so only for checking them there).
    ``matmul_precision``: how a TPU computes float32 matrix products and convolutions (JAX's ``default``: one
    bf16 pass, ``high``: three, ``highest``: float32; XLA on CPUs computes float32 either way). ``None`` (the
    default) follows torch's own knob at compile time, ``torch.get_float32_matmul_precision()``: ``highest``
    (torch's default, so an fp32 step computes what eager does) -> ``highest``, ``high`` -> ``high``,
    ``medium`` -> ``default``. recir-mixed-precision's bf16 products take bf16 operands and run one pass
    whatever this says.
    ``split_concat_products``: compute a product of a last-axis concatenation that nothing else reads (HSTU's
    ``concat[u, attn, y] @ W_out`` in a serving graph) as the sum of its parts' products
    (``recir-split-concat-products``). XLA on CPUs builds a concatenation as a copy: DLRMv3's full-sequence
    serving artifacts at batch 256 ran 6-17% faster with it on a 2-core EPYC (one core, two runs, fp32 and
    bf16). ``None`` (the default): on for JAX's CPU backend, off on a TPU (on a v5e the same artifacts ran
    from 2% faster to 4% slower with it).
    ``cpu_scheduler``: the order XLA:CPU runs a step's instructions in, which sets how large the one block of
    a call's temporaries is (``xla_cpu_scheduler_type``; JAX's CPU backend only, a TPU ignores it):
    ``memory`` (the default) picks the order that keeps the fewest bytes alive; ``concurrency`` XLA's own
    default, an order that lets independent instructions run side by side at the cost of more live
    temporaries. Full-size DLRMv3 on a 2-core EPYC (fp32, one token budget): a step's temporaries 273 ->
    207 MiB at UIH 64 and 906 -> 725 MiB at UIH 256; the process's peak at UIH 64 1.97-2.02 -> 1.91 GiB
    and the step 422-442 -> 384-388 ms; at UIH 256 the step within noise (see the package README for a heap
    growth seen there).
    """

    x64: bool | None = None
    sparse_updates: bool = True
    persistent_cache: bool = True
    cache_dir: str | None = None
    donate_state: bool = True
    host_checks: bool = True
    huge_pages_min_bytes: int | None = HUGE_PAGES_MIN_BYTES
    attention_kernel: str = "blocked"
    matmul_precision: str | None = None
    split_concat_products: bool | None = None
    cpu_scheduler: str = "memory"

    def __post_init__(self) -> None:
        if self.cpu_scheduler not in CPU_SCHEDULERS:
            raise ConfigError(
                f"TPUOptions(cpu_scheduler={self.cpu_scheduler!r}): expected one of {', '.join(CPU_SCHEDULERS)}"
            )
        if self.matmul_precision is not None and self.matmul_precision not in MATMUL_PRECISIONS.values():
            raise ConfigError(
                f"TPUOptions(matmul_precision={self.matmul_precision!r}): expected one of "
                f"{', '.join(MATMUL_PRECISIONS.values())}, or None to follow torch.get_float32_matmul_precision()"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(
                f"TPUOptions(attention_kernel={self.attention_kernel!r}): expected one of "
                f"{', '.join(ATTENTION_KERNELS)}"
            )


#: TPUOptions.cpu_scheduler -> XLA:CPU's ``xla_cpu_scheduler_type``
CPU_SCHEDULERS = {
    "memory": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
    "concurrency": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
}


def compiler_options(options: TPUOptions) -> dict[str, str]:
    """XLA options for ``jax.stages.Lowered.compile`` on this process's JAX backend (part of JAX's compilation
    cache key, so a cached program compiled under other options is not reused)."""
    if jax.default_backend() != "cpu":
        return {}
    return {"xla_cpu_scheduler_type": CPU_SCHEDULERS[options.cpu_scheduler]}


#: torch.get_float32_matmul_precision() -> the JAX precision of float32 products (TPUOptions.matmul_precision)
MATMUL_PRECISIONS = {"highest": "highest", "high": "high", "medium": "default"}


def matmul_precision(options: TPUOptions) -> str:
    """The JAX matmul precision a step compiled with ``options`` traces its float32 products with."""
    return options.matmul_precision or MATMUL_PRECISIONS[torch.get_float32_matmul_precision()]


def _with_matmul_precision(fn: Callable[..., Any], precision: str) -> Callable[..., Any]:
    """``fn`` traced under ``jax.default_matmul_precision(precision)``: the setting is read when each product
    is traced, so it binds this program only (not the process's other JAX code)."""

    def traced(*args: Any) -> Any:
        with jax.default_matmul_precision(precision):
            return fn(*args)

    return traced


#: ``init_state(release=...)`` trims the heap after releasing a source at least this large (a table)
_TRIM_AFTER_BYTES = 32 << 20


class TPUCompiledStep:
    """A StepGraph lowered to one jitted JAX program; implements recir.transforms' ``CompiledStep``."""

    def __init__(
        self,
        step: StepGraph,
        placement: Placement,
        options: TPUOptions,
        embedding_backend: Any,
        host_checks: Sequence[HostCheck] = (),
        pipeline: Pipeline | None = None,
    ):
        self.step = step
        #: the rewrites from capture's output to torchax's input (``pipeline.report()``)
        self.pipeline = pipeline
        self.host_checks = list(host_checks)
        self.placement = placement
        self.options = options
        self.embedding_backend = embedding_backend
        sig = step.signature
        self._state_shardings = [placement.state_sharding(s) for s in sig.state]
        self._batch_shardings = [placement.batch_sharding(b) for b in sig.batch]
        self.x64 = needs_x64(step) if options.x64 is None else options.x64
        if self.x64 and options.x64 is None:
            logger.info("recir.lower_tpu: x64 on for this step (it has 64-bit integer maths: rng slots)")
        self._compiled: Any = None
        # XLA:CPU's temporaries of one call (one block; 0 off the CPU backend), for make_heap_room
        self._host_temp_bytes = 0
        self._compile_seconds = 0.0
        self._trace_seconds = 0.0
        self._cache_hit: bool | None = None
        with self._x64():
            out_dtypes = [jax_dtype(s.dtype) for s in sig.state] + [jax_dtype(o.dtype) for o in sig.outputs]
        self._env = recir_env()
        check_lowerings(step, self._env)
        # Several processes (multi-host): outputs come back replicated, so every process reads them
        # from its own devices without another collective.
        self._multiprocess = placement.mesh is not None and jax.process_count() > 1
        out_sharding = placement.replicated() if self._multiprocess else None
        #: JAX's matmul precision for the float32 products (TPUOptions.matmul_precision, resolved now)
        self.matmul_precision = matmul_precision(options)
        self._fn = _with_matmul_precision(
            _ring_shift.with_ring_mesh(
                jax_step_fn(step, self._env, out_dtypes, placement.node_sharding), placement.mesh
            ),
            self.matmul_precision,
        )
        self._jitted = jax.jit(
            self._fn,
            donate_argnums=(0,) if options.donate_state else (),
            in_shardings=(self._state_shardings, self._batch_shardings),
            out_shardings=(self._state_shardings, out_sharding),
        )

    # -- CompiledStep ---------------------------------------------------------------------------
    @property
    def compile_seconds(self) -> float:
        """Seconds the first call spent tracing, lowering and compiling (0.0 before it)."""
        return self._compile_seconds

    @property
    def trace_seconds(self) -> float:
        """Of ``compile_seconds``, those torchax spent tracing the graph to StableHLO (``jit(...).lower``); the
        rest is XLA's compile (or the persistent cache's load). 0.0 before the first call."""
        return self._trace_seconds

    @property
    def cache_hit(self) -> bool | None:
        """Whether the first call loaded the program from the persistent cache (None before it)."""
        return self._cache_hit

    def init_state(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        release: Callable[[str], None] | None = None,
    ) -> list[jax.Array]:
        """The step's state from ``model`` and ``optimizer``, as JAX arrays of its own.

        ``release(slot_name)`` is called as soon as a slot's array is copied, so a caller that drops the
        model's tensor there (the DLRMv3 trainer's released weights) holds one copy of the weights plus
        one tensor at a time instead of two copies (full-size DLRMv3, with the heap trims below: building
        the state peaks at 1.98 GiB instead of 2.36 on a 2-core EPYC).
        """
        # the model's own tensors, not clones: each is copied into a JAX buffer anyway (no third copy); a
        # slot an initializer converts (a table stored fp16) is built only when its turn to be copied comes
        step = self.step
        lazy = [
            functools.partial(step.init_slot, s, model, optimizer, share_model=True)
            for s in step.signature.state
        ]
        return self._put_state(lazy, release)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> list[jax.Array]:
        return self._put_state(self.step.load_state_dict(state_dict))

    def state_dict(self, state: Sequence[jax.Array]) -> dict[str, torch.Tensor]:
        """Global host tensors by slot name (with several processes: a collective, call it in all)."""
        self._check_state(state)
        if self._multiprocess:
            with self._x64():
                state = gather_to_every_process(list(state), self.placement.replicated())
        return {slot.name: to_torch(x, slot.dtype) for slot, x in zip(self.step.signature.state, state)}

    def __call__(self, state: Sequence[Any], batch: Any) -> tuple[list[jax.Array], Any]:
        """One step. ``state`` (from ``init_state``) is donated: use the returned state afterwards."""
        self._check_state(state)
        sig = self.step.signature
        flat = sig.flatten_batch(batch)
        for check in self.host_checks:  # DataError before anything runs on the device
            check(flat)
        if not self.x64:
            check_int32("batch input", sig.batch, flat)
        with self._x64():
            jstate = [
                to_jax(x, sh, owned=True) if isinstance(x, torch.Tensor) else x
                for x, sh in zip(state, self._state_shardings)
            ]
            jbatch = [to_jax(t, sh) for t, sh in zip(flat, self._batch_shardings)]
            if self._compiled is None:
                self._compile(jstate, jbatch)
            if self._host_temp_bytes >= _HEAP_ROOM_MIN_BYTES:
                make_heap_room(self._host_temp_bytes)
            try:
                new_state, outs = self._compiled(jstate, jbatch)
                torch_outs = [to_torch(x, slot.dtype) for x, slot in zip(outs, sig.outputs)]
            except jax.errors.JaxRuntimeError as e:
                if "DataError" in str(e):  # a host-side data check (recir::check_jagged) failed
                    raise DataError(_data_error_message(str(e))) from e
                raise
        return list(new_state), self.step.unflatten_outputs(torch_outs)

    # -- inspection -------------------------------------------------------------------------------
    def lower(self) -> jax.stages.Lowered:
        """The lowered program (``.as_text()`` gives its StableHLO), from the signature's shapes."""
        sig = self.step.signature
        with self._x64():
            state = [
                jax.ShapeDtypeStruct(s.shape, jax_dtype(s.dtype), sharding=sh)
                for s, sh in zip(sig.state, self._state_shardings)
            ]
            batch = [
                jax.ShapeDtypeStruct(b.shape, jax_dtype(b.dtype), sharding=sh)
                for b, sh in zip(sig.batch, self._batch_shardings)
            ]
            return self._jitted.lower(state, batch)

    def export(
        self,
        path: str | os.PathLike[str],
        extra: Mapping[str, Any] | None = None,
        baked_state: Sequence[torch.Tensor] | None = None,
        platforms: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Write the step as a serialised ``jax.export`` artifact (StableHLO) to ``path`` and a manifest
        beside it (``path`` + ``.json``: inputs, outputs, shapes, dtypes, versions); returns the manifest.

        The artifact needs only JAX to run: ``exp = jax.export.deserialize(open(path, "rb").read())``,
        then ``new_state, outputs = exp.call(state, batch)`` with arrays in the manifest's order, shapes
        and dtypes (for a serving graph, ``recir.transforms.to_inference(step)`` first). With
        ``baked_state`` (the state values, ``step.init_state(model)``) the state is embedded in the
        program as constants and ``outputs = exp.call(batch)`` (the manifest's ``state`` is empty,
        ``baked_state`` lists them). Both files are written atomically. Single-device layout: a mesh's
        shardings are not exported. ``extra``: more manifest fields (e.g. the application's options).
        ``platforms``: the JAX platforms the artifact runs on (``"cpu"``, ``"tpu"``, ``"cuda"``,
        ``"rocm"``), one lowering each; default the backend exporting it, so an artifact written on a TPU
        host runs only on TPUs unless ``"cpu"`` is named too. The manifest lists them.
        """
        from jax import export as jax_export
        from recir.distributed import write_atomically
        from recir.embedding import QUANTIZE_KEY
        from recir.transforms import INFERENCE_KEY

        sig = self.step.signature
        if baked_state is not None:
            sig.check_state(baked_state, "TPUCompiledStep.export(baked_state=)")
            if not self.x64:  # baked as int32 constants, they would wrap as state would (_put_state)
                check_int32("baked state slot", sig.state, baked_state)
        targets = _export_platforms(platforms)
        with self._x64():
            state = [jax.ShapeDtypeStruct(s.shape, jax_dtype(s.dtype)) for s in sig.state]
            batch = [jax.ShapeDtypeStruct(b.shape, jax_dtype(b.dtype)) for b in sig.batch]
            if baked_state is None:
                exported = jax_export.export(jax.jit(self._fn), platforms=targets)(state, batch)
                out_avals = exported.out_avals[len(sig.state) :]
            else:
                device = jax.devices()[0]
                constants = [to_jax(t, jax.sharding.SingleDeviceSharding(device)) for t in baked_state]
                fn = self._fn
                # For a TPU, the constants pass an optimization barrier: XLA's algebraic simplifier
                # rewrites a product of two constants, a broadcast row times a weight (DLRMv3's candidate
                # graph: the action MLP on the expanded `action_encoder.target`), into a broadcast that
                # the TPU compiler's verifier rejects after layout (RET_CHECK, hlo_verifier.cc:1515; jax
                # 0.10.2, 1024 rows and more). The barrier hides the values, not the shapes.
                hide = "tpu" in (targets or (jax.default_backend(),))

                def serve(batch: list[jax.Array]) -> Any:
                    values = jax.lax.optimization_barrier(constants) if hide else constants
                    return fn(values, batch)[1]  # closed over: StableHLO constants

                exported = jax_export.export(jax.jit(serve), platforms=targets)(batch)
                out_avals = exported.out_avals

            def spec(name: str, x: Any) -> dict[str, Any]:
                return {"name": name, "shape": list(x.shape), "dtype": str(x.dtype)}

            state_specs = [spec(s.name, x) for s, x in zip(sig.state, state)]
            manifest = {
                "format": "jax.export (StableHLO), call as "
                + ("exp.call(batch) -> outputs" if baked_state is not None else "exp.call(state, batch)"),
                "versions": {"jax": jax.__version__, "torch": torch.__version__},
                "x64": self.x64,
                "platforms": list(exported.platforms),
                "state": [] if baked_state is not None else state_specs,
                "baked_state": state_specs if baked_state is not None else [],
                "batch": [spec(b.name, x) for b, x in zip(sig.batch, batch)],
                "outputs": [spec(o.name, x) for o, x in zip(sig.outputs, out_avals)],
                "meta": {k: v for k, v in self.step.meta.items() if k in (INFERENCE_KEY, QUANTIZE_KEY)},
                **(extra or {}),
            }
        write_atomically(path, bytes(exported.serialize()))
        write_atomically(f"{path}.json", json.dumps(manifest, indent=2, default=str))
        logger.info("recir.lower_tpu: exported the step to %s (%d bytes)", path, Path(path).stat().st_size)
        return manifest

    def __repr__(self) -> str:
        return (
            f"TPUCompiledStep({len(self.step.graph.nodes)} nodes on {jax.default_backend()}, "
            f"{self.placement.describe()}, x64={self.x64}, compiled={self._compiled is not None})"
        )

    # -- internals ----------------------------------------------------------------------------------
    def _compile(self, state: list[jax.Array], batch: list[jax.Array]) -> None:
        start, hits = time.perf_counter(), cache_hits()
        opts = self.options
        # Measured with jax 0.10.2: an executable that a CPU process loads from the persistent cache
        # hangs in its first cross-process collective, so multi-process CPU jobs compile afresh.
        multi_cpu = jax.default_backend() == "cpu" and jax.process_count() > 1
        cache = compile_cache(opts.cache_dir, enabled=opts.persistent_cache and not multi_cpu)
        # a later token budget's step compiles beside the last call's freed temporaries, which the heap keeps
        # (retain_host_memory): handed back first, the compiler's own temporaries do not come on top of them
        trim_host_heap()
        with cache:  # JAX's cache options set for this compile only, then put back
            traced = time.perf_counter()
            lowered = self._jitted.lower(state, batch)
            self._trace_seconds = time.perf_counter() - traced
            self._compiled = lowered.compile(compiler_options(opts))
        del lowered
        trim_host_heap()  # tracing's and XLA's temporaries
        self._host_temp_bytes = _host_temp_bytes(self._compiled)
        self._compile_seconds = time.perf_counter() - start
        self._cache_hit = cache_hits() > hits
        logger.info(
            "recir.lower_tpu: compiled the step in %.2fs (torchax trace to StableHLO %.2fs, then XLA on %s: %s)",
            self._compile_seconds,
            self._trace_seconds,
            jax.default_backend(),
            "persistent cache hit" if self._cache_hit else "compiled afresh",
        )

    def _x64(self) -> contextlib.AbstractContextManager[Any]:
        if bool(jax.config.read("jax_enable_x64")) == self.x64:
            return contextlib.nullcontext()
        return jax.enable_x64(self.x64)

    def _put_state(
        self,
        tensors: Sequence[torch.Tensor | Callable[[], torch.Tensor]],
        release: Callable[[str], None] | None = None,
    ) -> list[jax.Array]:
        """JAX arrays of ``tensors`` (or of what each callable returns, called when its slot is copied)."""
        slots = self.step.signature.state
        pending: list[Any] = list(tensors)
        del tensors  # each source is dropped once copied (with `release`, the caller drops its own too)
        if not self.x64:  # every slot before the first copy: `release` must not have dropped any yet
            ints = [i for i, s in enumerate(slots) if s.dtype == torch.int64]
            for i in ints:
                pending[i] = pending[i]() if callable(pending[i]) else pending[i]
            check_int32("state slot", [slots[i] for i in ints], [pending[i] for i in ints])
        with self._x64():
            state = []
            for i, (slot, sh) in enumerate(zip(self.step.signature.state, self._state_shardings)):
                source, pending[i] = pending[i], None
                source = source() if callable(source) else source
                assert source is not None
                large = source.numel() * source.element_size() >= _TRIM_AFTER_BYTES
                state.append(to_jax(source, sh, owned=True))
                del source
                if release is not None:
                    state[-1].block_until_ready()  # the copy exists: the source may go
                    release(slot.name)
                    if large:
                        trim_host_heap()  # its pages back now, not after the whole state is copied
        trim_host_heap()  # the sources and the copies' temporaries, freed between live allocations
        if self.options.huge_pages_min_bytes is not None:
            # in place, contents unchanged; donation keeps the buffers (and their pages) across steps
            buffers = [
                (s.data.unsafe_buffer_pointer(), s.data.nbytes)
                for x in state
                for s in x.addressable_shards
                if s.device.platform == "cpu"
            ]
            advise_large_buffers(buffers, self.options.huge_pages_min_bytes)
        return state

    def _check_state(self, state: Sequence[Any]) -> None:
        check_state_count(self.step, state)
        for slot, x in zip(self.step.signature.state, state):
            if isinstance(x, jax.Array) and x.is_deleted():
                raise ConfigError(
                    f"state slot {slot.name!r} was donated to an earlier step and no longer exists. "
                    "Fix: continue with the state that step returned (state, outputs = compiled(state, batch))."
                )


_PLATFORMS = ("cpu", "tpu", "cuda", "rocm")


def _export_platforms(platforms: Sequence[str] | None) -> tuple[str, ...] | None:
    """``export(platforms=)`` checked: None (the exporting backend) or known JAX platform names."""
    if platforms is None:
        return None
    if isinstance(platforms, str):
        platforms = (platforms,)
    bad = [p for p in platforms if p not in _PLATFORMS]
    if bad or not platforms:
        what = f"unknown JAX platform(s) {bad}" if bad else "no platform"
        raise ConfigError(
            f"TPUCompiledStep.export(platforms={list(platforms)!r}): {what}. "
            f"Fix: name one or more of {list(_PLATFORMS)}, or pass None for the backend exporting it."
        )
    return tuple(dict.fromkeys(platforms))


_INT32 = (-(2**31), 2**31 - 1)


def check_int32(what: str, slots: Sequence[Any], tensors: Sequence[torch.Tensor]) -> None:
    """DataError for a 64-bit integer tensor of ``tensors`` (``what``: ``batch input``, ``state slot``;
    named by its slot of ``slots``) with a value outside int32, for a step without x64: JAX would narrow it
    to int32 and the value would wrap silently."""
    for slot, t in zip(slots, tensors):
        if t.dtype != torch.int64 or t.numel() == 0:
            continue
        lo, hi = (int(v) for v in torch.aminmax(t.detach()))
        if lo < _INT32[0] or hi > _INT32[1]:
            raise DataError(
                f"{what} {slot.name!r} holds int64 values in [{lo}, {hi}], outside int32, and this step runs "
                "without x64 (TPUOptions(x64=None) turns it off for graphs without 64-bit integer maths), where "
                "they would wrap silently. Fix: compile with TPUOptions(x64=True), or bring the values into "
                "int32 range first (e.g. timestamps relative to a base time)."
            )


def needs_x64(step: StepGraph) -> bool:
    """Whether the step's integer maths needs 64 bits: rng slots, an integer constant beyond int32, or a
    64-bit ``carry:`` slot (a software-pipelined step's parts compile separately and pass their carries to
    each other: both keep them 64-bit, whatever else each part contains)."""
    if any(slot.kind == "rng" for slot in step.signature.state):
        return True
    if any(slot.kind == "carry" and slot.dtype.itemsize == 8 for slot in step.signature.state):
        return True
    for node in step.graph.nodes:
        if node.op != "call_function":
            continue
        for arg in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
            if type(arg) is int and not _INT32[0] <= arg <= _INT32[1]:
                return True
    return False


def _data_error_message(text: str) -> str:
    """The DataError's own message out of XLA's callback error text."""
    _, _, tail = text.partition("DataError: ")
    message = tail.strip() or text
    return (
        message + "\n(The step did not complete; its donated input state is gone: reload from a checkpoint.)"
    )


@overload
def compile(
    step: StepGraph,
    plan: ShardingPlan | None = None,
    *,
    mesh: Any = None,
    embedding_backend: Literal["cpu"],
    options: TPUOptions = ...,
) -> HostSplitCompiledStep: ...


@overload
def compile(
    step: StepGraph,
    plan: ShardingPlan | None = None,
    *,
    mesh: Any = None,
    embedding_backend: Literal["in_graph", "ring_shift"] | None = None,
    options: TPUOptions = ...,
) -> TPUCompiledStep: ...


@overload
def compile(
    step: StepGraph,
    plan: ShardingPlan | None = None,
    *,
    mesh: Any = None,
    embedding_backend: str | None = None,
    options: TPUOptions = ...,
) -> TPUCompiledStep | HostSplitCompiledStep: ...


def compile(
    step: StepGraph,
    plan: ShardingPlan | None = None,
    *,
    mesh: Any = None,
    embedding_backend: str | None = None,
    options: TPUOptions = TPUOptions(),  # noqa: B008 - frozen dataclass
) -> TPUCompiledStep | HostSplitCompiledStep:
    """Lower ``step`` to JAX: torchax traces its ATen graph, ``jax.jit`` compiles it with state donated.

    Runs on a TPU when JAX has one, else on JAX's CPU backend. ``plan`` (a recir.distributed
    ShardingPlan) shards state and batch over its mesh; ``mesh`` alone replicates over it; with neither,
    everything lives on the default device. ``embedding_backend``: recir-embedding's backend for the
    TPU target: ``None``/``"in_graph"``, or ``"ring_shift"`` (needs ``plan`` to shard every looked-up
    table row-wise: ids travel a device ring and each device gathers its own rows with a Pallas kernel;
    see ``recir.embedding.prepare_for_lowering``), or ``"cpu"``: the tables and their optimizer state
    stay on the host, looked up and updated row-wise by PyTorch on the CPU, and only the rest of the
    step is compiled (a ``HostSplitCompiledStep``; for tables larger than device memory). Compiles at
    the first call.
    """
    plan = as_plan(plan, "recir.lower_tpu.compile")
    check_private_apis()
    if verify_level() >= 1:
        verify(step, transform="recir.lower_tpu.compile")
    # recir-embedding's preparation (a copy; `step` is never mutated): sparse row-wise updates for
    # tables and the embedding backend's kernels. It drops recir::check_jagged on TPU; the checks run
    # on the host before each step instead (a graph that keeps one gets the io_callback lowering).
    checks = host_checks_of(step) if options.host_checks else []
    if checks:
        logger.info("recir.lower_tpu: %d id/length check(s) run on the host before each step", len(checks))
    placement = placement_for(mesh, plan)
    row_sharded = _ring_shift.row_sharded_tables(plan) if placement.mesh is not None else {}
    row_sharded = row_sharded if embedding_backend == "ring_shift" else {}
    name = resolve_backend(embedding_backend, "tpu", None, row_sharded)
    # The lowering's rewrites as code (recir.lower_tpu._pipeline.tpu_pipeline), on a private copy.
    pipeline = tpu_pipeline(
        step,
        sparse_updates=options.sparse_updates,
        backend=name,
        row_sharded=row_sharded,
        attention_kernel=options.attention_kernel,
        split_concat_products=(
            jax.default_backend() == "cpu"
            if options.split_concat_products is None
            else options.split_concat_products
        ),
    )
    step = pipeline.run(step.copy())
    report = embedding_report(pipeline, name, "tpu")
    step.meta["recir.embedding"] = report
    cut = next((t for t in pipeline.transforms if isinstance(t, CutHostSplit)), None)
    if cut is not None and cut.split is not None:
        split = cut.split
        split.step.meta["recir.embedding"] = report
        device = TPUCompiledStep(split.device, placement, options, "cpu", pipeline=pipeline)
        logger.info(
            "recir.lower_tpu: embedding backend 'cpu': %d table(s) on the host (%s), %d lookup(s), device "
            "part %s",
            len(split.tables),
            ", ".join(split.tables),
            len(split.lookup.signature.outputs),
            placement.describe(),
        )
        return HostSplitCompiledStep(split.step, split, device, HostEmbeddings(split), checks)
    backend = jax.default_backend()
    if options.persistent_cache and backend == "cpu" and jax.process_count() > 1:
        logger.info("recir.lower_tpu: persistent compile cache off (multi-process JAX on CPU)")
    if backend == "tpu":
        logger.info("recir.lower_tpu: lowering to TPU, %s", placement.describe())
    else:
        logger.info(
            "recir.lower_tpu: no TPU found; running on JAX's %s backend, %s",
            backend.upper(),
            placement.describe(),
        )
    return TPUCompiledStep(step, placement, options, embedding_backend, checks, pipeline=pipeline)
