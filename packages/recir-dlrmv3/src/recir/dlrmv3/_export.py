"""`recir-dlrmv3 export` and `predict`: a trained checkpoint as a served model on either stack.

`export` rebuilds the model from the checkpoint's recorded options, loads its parameters, captures the
training step, turns it into the serving graph (`recir.transforms.to_inference`: the multitask logits,
no dropout) and writes an AOTInductor package (`--target gpu`, runs with torch alone) or a `jax.export`
artifact (`--target tpu`, runs with JAX alone), the manifest beside it and the parameters as
`<out>.state.npz` (or, `--bake`, inside the artifact as constants). `--quantize int8|fp16` stores the
embedding tables row-wise quantised (recir-embed-quantize-tables); `--precision bf16` runs the matrix
products on bf16 copies of their operands (recir-mixed-precision on the serving graph). `predict` runs
such an artifact over a dataset's eval batches and prints the metrics `train` prints.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree
from recir.transforms import ConfigError, DataError

from ._options import TrainOptions


def _options(recorded: dict[str, Any], **changes: Any) -> TrainOptions:
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    kept = {k: v for k, v in recorded.items() if k in names}
    kept.update(changes)
    # run-only flags of the training run: not the served model's business
    for key in ("checkpoint_dir", "checkpoint_every", "resume", "overwrite", "tensorboard_dir", "profile"):
        kept.pop(key, None)
    return TrainOptions(**kept)


def serving_pipeline(quantize: str | None, precision: str, quantize_kernel: str = "aten") -> Any:
    """The rewrites `export` applies to the serving graph (a `recir.transforms.Pipeline`, empty for fp32
    tables and products): `quantize` ("int8"/"fp16") tables row-wise, stored for `quantize_kernel`
    ("aten": plain ATen; "fbgemm": FBGEMM's inference-TBE rows), `precision="bf16"` products."""
    from recir.embedding import QuantizeTables
    from recir.transforms import MixedPrecision, Pipeline

    transforms: list[Any] = (
        [] if quantize is None else [QuantizeTables(dtype=quantize, kernel=quantize_kernel)]
    )
    if precision == "bf16":
        transforms.append(MixedPrecision(compute_dtype="bfloat16", phases=("forward",)))
    return Pipeline(transforms, name="serving")


def export_model(
    checkpoint: str,
    target: str,
    out: str,
    log: Callable[[str], None] = print,
    quantize: str | None = None,
    bake: bool = False,
    serving: str = "full",
    candidates: int | None = None,
    precision: str = "fp32",
    quantize_kernel: str = "aten",
    platforms: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Export the checkpoint at `checkpoint` for `target` (gpu|tpu) to `out`; returns the manifest.

    `quantize`: `"int8"` or `"fp16"` embedding tables (None: float32 as trained); `bake`: the parameters
    compiled into the artifact (no `.state.npz`). `serving="cached-history"`: two artifacts instead,
    `out.history` and `out.candidates` (`_serving_export`: the serving graph split by
    `recir.transforms.cached_history`), the parameters baked, each user scored against `candidates`
    candidates (default: the trained `--num_candidates`; static, one export per count), `quantize` and
    `precision` applied to both graphs. `precision="bf16"`: the serving graph's matrix products on bf16
    copies of their fp32 operands, results back in fp32 (`recir-mixed-precision`, forward phase);
    parameters stay fp32. `quantize_kernel="fbgemm"`: the quantised
    tables in FBGEMM's inference-TBE rows, read by FBGEMM's kernel in the GPU stack's package (which then
    needs `fbgemm_gpu` to load) and by the same rows' ATen reference on the TPU stack. `platforms`
    (tpu only): the JAX platforms the artifact is lowered for (default the exporting backend's)."""
    if platforms and target != "tpu":
        raise ConfigError(
            f"export: platforms {list(platforms)} name JAX platforms of a jax.export artifact (--target tpu); "
            f"--target {target} writes an AOTInductor package for the device it is built on. Fix: drop "
            "--platforms, or export with --target tpu."
        )
    from recir.capture import capture_train_step, load_into
    from recir.distributed import write_atomically
    from recir.embedding import QUANT_DTYPES, QUANT_KERNELS, QuantizeTables, overrides
    from recir.transforms import MixedPrecision, to_inference

    from ._checkpoint import load_checkpoint
    from ._model import loss_fn
    from ._train import build

    if target not in ("gpu", "tpu"):
        raise ConfigError(f"--target must be gpu or tpu for export, got {target!r}")
    if quantize not in (None, "none", *QUANT_DTYPES):
        raise ConfigError(f"--quantize must be one of none, {', '.join(QUANT_DTYPES)}; got {quantize!r}")
    quantize = None if quantize == "none" else quantize
    if quantize_kernel not in QUANT_KERNELS:
        raise ConfigError(
            f"--quantize_kernel must be one of {', '.join(QUANT_KERNELS)}; got {quantize_kernel!r}"
        )
    if quantize_kernel != "aten" and quantize is None:
        raise ConfigError(
            f"--quantize_kernel {quantize_kernel} reads quantised tables. Fix: add --quantize int8 or fp16"
        )
    if serving not in ("full", "cached-history"):
        raise ConfigError(f"--serving must be full or cached-history, got {serving!r}")
    if precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision must be fp32 or bf16 for export, got {precision!r}")
    state, meta = load_checkpoint(checkpoint)
    recorded = _options(meta.get("options", {}), target=target)
    if serving == "cached-history":
        # the shapes served: the trained batch size, `candidates` per user (the parameters do not depend
        # on the candidate count); the normaliser stays the trained one (serving_max_len)
        count = recorded.num_candidates if candidates is None else candidates
        if count < 1:
            raise ConfigError(
                f"--candidates must be at least 1 (candidates scored per user), got {count}. Fix: pass --candidates N, N >= 1"
            )
        opts = dataclasses.replace(recorded, num_candidates=count)
    else:
        opts = recorded
    model, data, optimizers = build(opts)
    load_into(model, (), state)
    if serving == "cached-history":
        from ._serving import serving_max_len
        from ._serving_export import export_cached_history

        info = {"target": target, "checkpoint": str(checkpoint), "step": meta.get("step"),
                "options": dataclasses.asdict(recorded)}  # fmt: skip
        max_len = serving_max_len(model, num_candidates=recorded.num_candidates)
        log(f"export: {checkpoint} (step {meta.get('step')}) as cached-history serving, {count} candidate(s)")
        manifest = export_cached_history(
            model, optimizers, data.train_batch(0), target, out, max_seq_len=max_len, quantize=quantize,
            precision=precision, quantize_kernel=quantize_kernel, extra={"dlrmv3": info}, platforms=platforms,
        )  # fmt: skip
        g = manifest["graphs"]
        log(
            f"export: {g['layers']} attention op(s) split into history and candidates ({g['history_nodes']} and "
            f"{g['candidate_nodes']} nodes against the serving graph's {g['serving_nodes']}); wrote {out}.history, "
            f"{out}.candidates and {Path(out).name}.json"
        )
        return manifest
    model.train()
    log(f"export: {checkpoint} (step {meta.get('step')}) for --target {target}")
    step = capture_train_step(model, optimizers, loss_fn, data.train_batch(0), overrides=overrides())
    served = to_inference(step)  # aux.0: the multitask logits
    pipeline = serving_pipeline(quantize, precision, quantize_kernel)
    stats: dict[str, Any] = {}
    if pipeline.transforms:
        served = pipeline.run(served)
        stats = {r.name: r.stats for r in pipeline.records}
    if quantize is not None:
        q = stats[QuantizeTables.name]
        log(
            f"export: {q.get('tables', 0)} table(s) stored {quantize} for the {quantize_kernel} kernel: "
            f"{q.get('table_bytes', 0)} -> {q.get('quantized_bytes', 0)} bytes"
        )
    if precision == "bf16":
        mp = stats[MixedPrecision.name]
        log(f"export: {mp.get('matmuls', 0)} matrix product(s) in bf16 ({mp.get('casts', 0)} casts)")
    tensors = served.init_state(model, optimizers)
    out_path = Path(out)
    state_file = Path(f"{out_path}.state.npz")
    if not bake:
        buffer = io.BytesIO()
        np.savez(
            buffer, **{s.name: t.detach().cpu().numpy() for s, t in zip(served.signature.state, tensors)}
        )
        write_atomically(state_file, buffer.getvalue())
    extra = {
        "state_file": None if bake else state_file.name,
        "dlrmv3": {
            "target": target,
            "checkpoint": str(checkpoint),
            "step": meta.get("step"),
            "quantize": quantize or "none",
            "quantize_kernel": quantize_kernel,
            "precision": precision,
            "bake": bake,
            "options": dataclasses.asdict(opts),
        },
    }
    baked = tensors if bake else None
    if target == "gpu":
        from recir.lower_gpu import export

        manifest = export(served, out_path, extra=extra, baked_state=baked)
    else:
        from recir.lower_tpu import compile

        manifest = compile(served).export(out_path, extra=extra, baked_state=baked, platforms=platforms)
    wrote = f"{out_path}" + ("" if bake else f", {state_file.name}")
    log(f"export: wrote {wrote} and {out_path.name}.json")
    return manifest


def predict(
    artifact: str,
    num_batches: int,
    dataset: str | None = None,
    data_dir: str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Run the exported `artifact` over `num_batches` eval batches; returns (and logs) `train`'s eval
    metrics plus the artifact's latency per batch (`predict/p50_ms`, `predict/p99_ms`: each batch's call,
    inputs converted and logits back as a torch tensor, after one untimed warm-up call on the first batch)
    and throughput (`predict/samples_per_s`: users scored per second of those calls)."""
    from ._metrics import MetricAccumulator
    from ._train import build

    manifest_path = Path(f"{artifact}.json")
    if not manifest_path.is_file():
        raise DataError(
            f"{manifest_path}: no manifest beside the artifact. Fix: pass a file written by export"
        )
    manifest = json.loads(manifest_path.read_text())
    info = manifest.get("dlrmv3")
    if not info:
        raise DataError(f"{manifest_path}: not a recir-dlrmv3 export (no 'dlrmv3' section)")
    changes: dict[str, Any] = {}
    if dataset is not None:
        changes["dataset"] = dataset
    if data_dir is not None:
        changes["data_dir"] = data_dir
    opts = _options(info["options"], **changes)
    model, data, _ = build(opts)  # labels and batches only: the artifact computes the logits
    if manifest.get("serving") == "cached-history":
        run = _cached_runner(artifact, model, manifest)
    else:
        state: list[Any] = []
        if manifest.get("state_file"):  # else the parameters are baked into the artifact
            arrays = np.load(Path(artifact).parent / manifest["state_file"])
            state = [arrays[s["name"]] for s in manifest["state"]]
        flat_run = _runner(info["target"], artifact, state, manifest)
        run = lambda batch: flat_run(pytree.tree_leaves(batch))  # noqa: E731
    acc = MetricAccumulator(tuple(t.name for t in data.spec.tasks))
    seconds: list[float] = []
    samples = 0
    for i, batch in enumerate(data.eval_batches(num_batches)):
        labels, weights = model.labels(batch)
        if i == 0:
            run(batch)  # warm-up, not timed: a JAX artifact compiles on its first call
        started = time.perf_counter()
        logits = run(batch)
        seconds.append(time.perf_counter() - started)
        samples += int(logits.shape[0])
        acc.update(logits, labels, weights)
    metrics = acc.compute()
    ms = np.asarray(seconds) * 1000.0
    timing = {
        "predict/p50_ms": float(np.percentile(ms, 50)),
        "predict/p99_ms": float(np.percentile(ms, 99)),
        "predict/samples_per_s": samples / max(float(ms.sum()) / 1000.0, 1e-9),
    }
    log(
        f"predict: {artifact} on {opts.dataset}, {num_batches} batch(es): "
        + " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        + f"; per batch p50 {timing['predict/p50_ms']:.2f} ms, p99 {timing['predict/p99_ms']:.2f} ms, "
        f"{timing['predict/samples_per_s']:.1f} samples/s (after one warm-up call)"
    )
    return {**metrics, **timing}


def _cached_runner(artifact: str, model: Any, manifest: dict[str, Any]) -> Callable[[Any], torch.Tensor]:
    """A batch -> logits through the two cached-history artifacts (history, then candidates), with the
    normaliser pinned as exported (so logits equal eager ones on batches given that normaliser)."""
    from ._serving_export import load_cached_history

    history_fn, candidates_fn = load_cached_history(artifact)
    users, count = manifest["users"], manifest["candidates"]

    def run(batch: Any) -> torch.Tensor:
        got_users, got_count = batch.cand_actions.shape
        if (got_users, got_count) != (users, count):
            raise DataError(
                f"{artifact}: exported for {users} users x {count} candidates per batch (static shapes), "
                f"but the eval batches are {got_users} x {got_count}. Fix: export with the batch size of the "
                f"data and --candidates {got_count}"
            )
        batch.max_seq_len = torch.full_like(batch.max_seq_len, manifest["max_seq_len"])
        leaves = pytree.tree_leaves(batch)
        logits: torch.Tensor = candidates_fn(*leaves, *history_fn(*leaves))
        return logits

    return run


def _runner(
    target: str, artifact: str, state: list[Any], manifest: dict[str, Any]
) -> Callable[[list[Any]], torch.Tensor]:
    if target == "gpu":
        device = torch.device(manifest.get("device", "cpu"))
        if "fbgemm_gpu" in manifest.get("requires", ()):
            try:  # the package calls FBGEMM's inference TBE: its ops must be registered before loading
                import fbgemm_gpu  # noqa: F401
            except ImportError as err:
                raise ImportError(
                    f"{artifact}: the package calls FBGEMM's kernels (exported with --quantize_kernel fbgemm) "
                    "and fbgemm_gpu is not importable. Fix: install fbgemm-gpu-cpu (CPU) or fbgemm-gpu (CUDA)"
                ) from err
        importlib.import_module("torch._inductor.codecache")  # aoti_load_package uses it on torch 2.10
        package = torch._inductor.aoti_load_package(str(artifact))
        tstate = [torch.from_numpy(np.asarray(x)).to(device) for x in state]

        def run_gpu(flat: list[Any]) -> torch.Tensor:
            return package(*tstate, *[t.to(device) for t in flat])[-1].cpu()

        return run_gpu
    import jax
    from jax import export as jax_export

    exp = jax_export.deserialize(bytearray(Path(artifact).read_bytes()))
    dtypes = [b["dtype"] for b in manifest["batch"]]
    with jax.enable_x64(bool(manifest.get("x64"))):
        jstate = [jax.numpy.asarray(x) for x in state]

    def run_tpu(flat: list[Any]) -> torch.Tensor:
        with jax.enable_x64(bool(manifest.get("x64"))):
            batch = [np.asarray(t).astype(d) for t, d in zip(flat, dtypes)]
            outs = exp.call(batch) if manifest.get("baked_state") else exp.call(jstate, batch)[1]
        return torch.from_numpy(np.asarray(outs[0]))

    return run_tpu
