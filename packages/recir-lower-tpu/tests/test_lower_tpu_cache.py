"""The persistent compile cache: a new process reuses a compiled step; a changed graph never does.

JAX keys cache entries on the lowered program's HLO fingerprint (plus backend, compile options and
versions), so a graph that differs only in a constant gets its own entry and its own results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from recir.lower_tpu import compile, default_cache_dir
from torch import nn

# Not marked `tpu`: device count plays no part, and its two subprocesses are the slowest test here;
# the cpu session runs it.

TESTS = Path(__file__).parent

SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
import torch
from torch import nn
from conftest import build_sgd_step
from recir.lower_tpu import compile

results = []
for lr in map(float, sys.argv[1:]):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    batch = {{"x": torch.ones(2, 3), "y": torch.zeros(2, 1)}}
    compiled = compile(build_sgd_step(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), batch, lr=lr))
    state = compiled.init_state(model)
    old = state
    state, (loss,) = compiled(state, batch)
    results.append({{
        "compile_seconds": compiled.compile_seconds,
        "cache_hit": compiled.cache_hit,
        "donated": all(x.is_deleted() for x in old),
        "weight": compiled.state_dict(state)["param:0.weight"].tolist(),
    }})
print(json.dumps(results))
"""


def _run(tmp_path: Path, *lrs: float) -> list[dict]:
    env = {
        **os.environ,
        "RECIR_CACHE_DIR": str(tmp_path),
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
    }
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=str(TESTS)), *map(str, lrs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _eager_weight(lr: float) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ((model(torch.ones(2, 3)) - torch.zeros(2, 1)) ** 2).mean().backward()
    opt.step()
    return model[0].weight.detach()


def test_new_process_hits_the_cache_and_changed_graph_does_not(tmp_path):
    (first,) = _run(tmp_path, 0.1)
    assert first["cache_hit"] is False and first["donated"]
    assert any((tmp_path / "jax").iterdir()), "the first compile must write $RECIR_CACHE_DIR/jax"

    # A new process: the same step loads from the cache; a step differing only in one constant (the
    # learning rate; same shapes) is a different HLO, so it compiles afresh and computes its own result.
    second, changed = _run(tmp_path, 0.1, 0.3)
    assert second["cache_hit"] is True, "a new process must load the program from the persistent cache"
    assert second["compile_seconds"] < first["compile_seconds"]
    assert second["donated"], "a program loaded from the cache still donates its state"
    assert second["weight"] == first["weight"]
    assert changed["cache_hit"] is False
    torch.testing.assert_close(torch.tensor(changed["weight"]), _eager_weight(0.3), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(first["weight"]), _eager_weight(0.1), atol=1e-6, rtol=1e-5)


def test_changed_graph_in_one_process_gives_its_own_result(sgd_step):
    results = {}
    for lr in (0.1, 0.3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        batch = {"x": torch.ones(2, 3), "y": torch.zeros(2, 1)}
        compiled = compile(sgd_step(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), batch, lr=lr))
        state, _ = compiled(compiled.init_state(model), batch)
        results[lr] = compiled.state_dict(state)["param:0.weight"]
        torch.testing.assert_close(results[lr], _eager_weight(lr), atol=1e-6, rtol=1e-5)
    assert not torch.equal(results[0.1], results[0.3])


def test_cache_dir_follows_recir_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RECIR_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "jax"
    monkeypatch.delenv("RECIR_CACHE_DIR")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "recir" / "jax"
