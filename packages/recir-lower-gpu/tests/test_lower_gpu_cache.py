"""The persistent compile cache: different graphs never share an artifact; a new process reuses it.

Inductor keys its FX graph cache (and AOTAutograd's cache) by the graph, so the lr baked into a
step is part of the key. A fresh process with the same cache folder loads instead of compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import recir.lower_gpu as lg
import torch
import torch._inductor.compile_fx  # noqa: F401  (import cost stays out of compile_seconds)
from _lower_gpu_steps import TinyMLP, mlp_batch, mse_loss, sgd_step_graph
from torch._dynamo.utils import counters

HERE = Path(__file__).parent


def _step(lr: float):
    torch.manual_seed(0)
    model = TinyMLP(din=6, hidden=12)
    return model, sgd_step_graph(model, mse_loss, mlp_batch(0, din=6), lr=lr, momentum=0.0)


def _cache_counts() -> dict[str, int]:
    from recir.lower_gpu._direct import stats

    return {
        "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "decomposed_loaded": stats["loaded"],
        "decomposed_traced": stats["traced"],
    }


def _diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch, torch._inductor.compile_fx
    sys.path.insert(0, sys.argv[1])
    import recir.lower_gpu as lg
    from test_lower_gpu_cache import _step, _cache_counts
    model, step = _step(0.1)
    compiled = lg.compile(step, device="cpu", options=lg.GPUOptions(cache_dir=sys.argv[2]))
    state, out = compiled(compiled.init_state(model), __import__("_lower_gpu_steps").mlp_batch(0, din=6))
    print(json.dumps({"seconds": compiled.compile_seconds, "loss": out[0].item(), **_cache_counts()}))
    """
)


def test_cache_keys_by_graph_and_a_new_process_reuses_it(tmp_path):
    cache = str(tmp_path / "inductor")
    opts = lg.GPUOptions(cache_dir=cache)
    model_a, step_a = _step(0.1)
    _, step_b = _step(0.2)

    c0 = _cache_counts()
    compiled_a = lg.compile(step_a, device="cpu", options=opts)
    c1 = _cache_counts()
    compiled_b = lg.compile(step_b, device="cpu", options=opts)
    c2 = _cache_counts()
    assert _diff(c1, c0)["fx_miss"] == 1 and _diff(c1, c0)["fx_hit"] == 0
    # Same structure, another lr: a different key, so a miss (never A's artifact).
    assert _diff(c2, c1)["fx_miss"] == 1 and _diff(c2, c1)["fx_hit"] == 0
    assert any(Path(cache).rglob("*.py")), "Inductor wrote nothing into the configured cache folder"

    batch = mlp_batch(0, din=6)
    results = []
    for step, compiled in ((step_a, compiled_a), (step_b, compiled_b)):
        state = compiled.init_state(model_a)
        ref, _ = step(step.init_state(model_a), batch)
        state, _ = compiled(state, batch)
        for got, want in zip(state, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        results.append(state[0].clone())
    assert not torch.allclose(results[0], results[1])  # the two lrs really produced two programs

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(HERE), cache], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    # The new process loads the artifacts instead of compiling (the hit counters say so; how long that
    # takes is benchmarks/step.py's business: no test measures time): on the CPU without AOTAutograd
    # (GPUOptions.aot_autograd), so the decomposed graph comes from the cache folder, not a new trace.
    assert child["fx_hit"] == 1 and child["fx_miss"] == 0, child
    assert child["decomposed_loaded"] == 1 and child["decomposed_traced"] == 0 and child["aot_hit"] == 0, (
        child
    )


def test_cpu_thread_count_is_part_of_the_cache_key(tmp_path):
    """Inductor's C++ kernels bake in the OpenMP thread count (1: no parallel loops), so a step compiled
    with 1 thread must not be reused by a process with 2 (it would run serial)."""
    threads = torch.get_num_threads()
    options = lg.GPUOptions(cache_dir=str(tmp_path))
    misses = []
    try:
        for n in (1, 2, 2):
            torch.set_num_threads(n)
            before = _cache_counts()
            lg.compile(_step(0.1)[1], device="cpu", options=options)
            misses.append(_diff(_cache_counts(), before)["fx_miss"])
    finally:
        torch.set_num_threads(threads)
    assert misses == [1, 1, 0]  # 2 threads compile afresh, then hit their own entry
