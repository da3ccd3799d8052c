"""Training-step speed, compile time and memory: eager PyTorch vs torch.compile vs RecIR's GPU and TPU paths.

One run prints one table. Every path runs in its own fresh Python process (same model, seed and
batches), so peak memory is per path and the "cached" row really is a new process that reuses the
Inductor cache the cold RecIR GPU row filled. Run ``uv run python benchmarks/step.py --help``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

PATHS = ("eager", "torch_compile", "recir_gpu", "recir_gpu_cached", "recir_gpu_dense", "recir_tpu")
LABELS = {
    "eager": "eager PyTorch (backward + opt.step)",
    "torch_compile": "torch.compile(model) + eager optimizer",
    "recir_gpu": "RecIR GPU path (Inductor), cold cache",
    "recir_gpu_cached": "RecIR GPU path, cached (new process)",
    "recir_gpu_dense": "RecIR GPU path, dense table updates",
    "recir_tpu": "RecIR TPU path (torchax -> JAX)",
}


# -- the model: EmbeddingBag tables feeding a small transformer ------------------------------------
class Block(nn.Module):
    """Pre-LN self-attention (SDPA) + GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class RecModel(nn.Module):
    """One pooled token per sparse feature (nn.EmbeddingBag, sum) plus a dense token, then transformer blocks."""

    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.tables = nn.ModuleList([nn.EmbeddingBag(a.rows, a.dim, mode="sum") for _ in range(a.tables)])
        self.dense = nn.Linear(a.dense, a.dim)
        self.blocks = nn.ModuleList([Block(a.dim, a.heads) for _ in range(a.layers)])
        self.norm = nn.LayerNorm(a.dim)
        self.head = nn.Linear(a.dim, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = [t(batch[f"ids_{i}"], batch[f"offsets_{i}"]) for i, t in enumerate(self.tables)]
        x = torch.stack([*tokens, self.dense(batch["dense"])], dim=1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1)).squeeze(-1)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(model(batch), batch["label"])


def make_batch(a: argparse.Namespace, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for i in range(a.tables):
        out[f"ids_{i}"] = torch.randint(0, a.rows, (a.batch * a.bag,), generator=g)
        out[f"offsets_{i}"] = torch.arange(0, a.batch * a.bag, a.bag)
    out["dense"] = torch.randn(a.batch, a.dense, generator=g)
    out["label"] = torch.randint(0, 2, (a.batch,), generator=g).float()
    return out


def make_optimizer(a: argparse.Namespace, params: Any) -> torch.optim.Optimizer:
    if a.optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=a.lr)
    if a.optimizer == "adam":
        return torch.optim.Adam(params, lr=a.lr)
    return torch.optim.SGD(params, lr=a.lr)


# -- memory: resident set size of this process (Linux /proc) ----------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


# -- one path, in this (worker) process --------------------------------------------------------------
def run_worker(a: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(a.threads)
    path = a.worker
    # Library imports happen before any clock starts, for every path alike.
    importlib.import_module("torch._inductor.compile_fx")
    if path.startswith("recir"):
        importlib.import_module("recir.embedding")
        from recir.capture import capture_train_step
        from recir.embedding import EmbeddingBagOverride
    torch.manual_seed(0)
    model = RecModel(a)
    optimizer = make_optimizer(a, model.parameters())
    batches = [make_batch(a, i) for i in range(4)]
    result: dict[str, Any] = {"path": path, "capture_s": None, "compile_s": 0.0, "note": ""}

    if path in ("eager", "torch_compile"):
        fwd = torch.compile(model) if path == "torch_compile" else model

        def step(batch: dict[str, torch.Tensor]) -> float:
            loss = loss_fn(fwd, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return float(loss)

        t0 = time.perf_counter()
        step(batches[0])  # the first step (torch.compile compiles forward and backward here)
        if path == "torch_compile":
            result["compile_s"] = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        captured = capture_train_step(
            model, optimizer, loss_fn, batches[0], overrides=(EmbeddingBagOverride(),)
        )
        result["capture_s"] = time.perf_counter() - t0
        if path == "recir_tpu":
            import recir.lower_tpu as lt

            compiled: Any = lt.compile(
                captured, options=lt.TPUOptions(cache_dir=os.path.join(a.cache_dir, "jax"))
            )
        else:
            import recir.lower_gpu as lg

            opts = lg.GPUOptions(
                cache_dir=os.path.join(a.cache_dir, "inductor"), sparse_updates=path != "recir_gpu_dense"
            )
            compiled = lg.compile(captured, device=a.device, options=opts)
            result["note"] = f"embedding backend {compiled.embedding_backend}"
        state = compiled.init_state(model, optimizer)
        del model, optimizer  # the compiled step owns the state now (eager paths keep theirs)
        holder = {"state": state}

        def step(batch: dict[str, torch.Tensor]) -> float:
            holder["state"], outputs = compiled(holder["state"], batch)
            return float(outputs[0])  # float() waits for the step (JAX and CUDA are asynchronous)

        t0 = time.perf_counter()
        step(batches[0])  # the TPU path compiles at its first call
        first = time.perf_counter() - t0
        result["compile_s"] = compiled.compile_seconds if compiled.compile_seconds > 0 else first

    losses = [step(batches[i % len(batches)]) for i in range(a.warmup)]
    pre_loop_rss = _status_kib("VmRSS")
    result["peak_rss_mib"] = _status_kib("VmHWM") / 1024
    reset = _reset_peak_rss()
    times = []
    for i in range(a.steps):
        t0 = time.perf_counter()
        losses.append(step(batches[i % len(batches)]))
        times.append((time.perf_counter() - t0) * 1e3)
    result["peak_rss_mib"] = max(result["peak_rss_mib"], _status_kib("VmHWM") / 1024)
    result["steady_peak_mib"] = _status_kib("VmHWM") / 1024 if reset else None
    result["pre_loop_rss_mib"] = pre_loop_rss / 1024
    result["ms"] = statistics.median(times)
    result["ms_min"] = min(times)
    result["loss_last"] = losses[-1]
    return result


# -- the driver ---------------------------------------------------------------------------------------
def _spawn(a: argparse.Namespace, path: str) -> dict[str, Any]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", path]
    for key, value in vars(a).items():
        if key in ("worker", "paths", "json"):
            continue
        argv += [f"--{key.replace('_', '-')}", str(value)]
    env = dict(os.environ)
    env.setdefault("RECIR_VERIFY", "0")  # verification is a test-time cost, not part of a step
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"path": path, "error": tail[0][:160]}
    return json.loads(lines[-1])


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    by = {r["path"]: r for r in rows}
    eager = by.get("eager", {})
    tc = by.get("torch_compile", {})
    print(
        f"# step benchmark: batch {a.batch}, {a.tables} EmbeddingBag tables x {a.rows} rows x {a.dim} "
        f"(bag {a.bag}), {a.layers} transformer blocks (d {a.dim}, {a.heads} heads), {a.optimizer} lr {a.lr}; "
        f"device {a.device}; {a.threads} threads on {os.cpu_count()} cores; torch {torch.__version__}; "
        f"median of {a.steps} steps after {a.warmup} warm-up; load average {os.getloadavg()[0]:.1f}"
    )
    print("# memory: resident set size (RSS, /proc/self/status) of each path's own process; 'steady' is")
    print("# the peak during the timed steps (VmHWM reset after warm-up), 'peak' includes compiling.")
    head = ("path", "ms/step", "x eager", "x t.compile", "capture s", "compile s", "steady MiB", "peak MiB")
    print("| " + " | ".join(head) + " | notes |")
    print("|" + "---|" * (len(head) + 1))
    for r in rows:
        if "error" in r:
            print(f"| {LABELS[r['path']]} | - | - | - | - | - | - | - | skipped: {r['error']} |")
            continue
        vs_eager = eager.get("ms") / r["ms"] if eager.get("ms") else None
        vs_tc = tc.get("ms") / r["ms"] if tc.get("ms") else None
        cells = [
            LABELS[r["path"]],
            _fmt(r["ms"], ".1f"),
            _fmt(vs_eager, ".2f"),
            _fmt(vs_tc, ".2f"),
            _fmt(r.get("capture_s"), ".1f"),
            _fmt(r.get("compile_s"), ".1f"),
            _fmt(r.get("steady_peak_mib"), ".0f"),
            _fmt(r.get("peak_rss_mib"), ".0f"),
        ]
        print("| " + " | ".join(cells) + f" | {r.get('note', '')} loss {r['loss_last']:.4f} |")
    goals = []
    for key in ("recir_gpu", "recir_tpu"):
        r = by.get(key, {})
        if "ms" not in r:
            continue
        checks = [
            f">=2x eager: {'met' if eager.get('ms', 0) / r['ms'] >= 2 else 'MISSED'}",
            f">=1.3x torch.compile: {'met' if tc.get('ms', 0) / r['ms'] >= 1.3 else 'MISSED'}",
            "steady memory <= eager: "
            + (
                "met"
                if (r.get("steady_peak_mib") or 1e9) <= (eager.get("steady_peak_mib") or 0)
                else "MISSED"
            ),
        ]
        goals.append(f"# goals {LABELS[key]}: " + "; ".join(checks))
    cached = by.get("recir_gpu_cached", {})
    if "compile_s" in cached:
        goals.append(f"# goal cached recompile < 3 s: {'met' if cached['compile_s'] < 3 else 'MISSED'}")
    print("\n".join(goals))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--tables", type=int, default=8, help="EmbeddingBag tables (one feature each)")
    p.add_argument("--rows", type=int, default=50_000, help="rows per table")
    p.add_argument("--dim", type=int, default=64, help="embedding dim = transformer width")
    p.add_argument("--bag", type=int, default=8, help="ids per bag")
    p.add_argument("--dense", type=int, default=16, help="dense input features")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--optimizer", choices=("adagrad", "adam", "sgd"), default="adagrad")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: stable on a shared machine)"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="RecIR GPU path device"
    )
    p.add_argument("--cache-dir", default=None, help="compile caches (default: a fresh temporary folder)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per path")
    p.add_argument("--json", action="store_true", help="also print the raw rows as JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(run_worker(a)))
        return
    a.cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="recir-bench-cache-")
    paths = [x for x in a.paths.split(",") if x]
    unknown = set(paths) - set(PATHS)
    if unknown:
        p.error(f"unknown paths {sorted(unknown)}; choose from {PATHS}")
    if "recir_tpu" in paths:
        try:
            import recir.lower_tpu  # noqa: F401
        except ImportError as exc:
            paths.remove("recir_tpu")
            print(f"# RecIR TPU path skipped: recir.lower_tpu is unavailable ({exc})")
    rows = []
    for path in paths:
        print(f"# running {path} ...", file=sys.stderr, flush=True)
        rows.append(_spawn(a, path))
    print(
        f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {platform.platform()}"
    )
    print_table(a, rows)
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
