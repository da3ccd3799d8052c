#!/usr/bin/env bash
# One prepared TPU-path run for a lent TPU machine (the device tool's tpu-v5e): its own Python 3.11 with JAX and
# libtpu preinstalled, torch only as a CPU wheel in /opt/wheels, no package index for the rest. RecIR runs from
# its sources on PYTHONPATH; TorchRec, FBGEMM's CPU build, torchax and their needs travel as wheels in .whl-tpu/
# (the README's "On a TPU" names them). Stages (STAGES, default "env smoke bench tests"), logs under $OUT:
#   env    versions and devices;
#   smoke  a 6-step DLRMv3 run through the TPU trainer;
#   bench  benchmarks/dlrmv3.py, TPU rows (BENCH_ARGS, default UIH 64 and 256, fp32 and bf16, one token budget:
#          a full-size row's cold compile took 109 s on a v5e, so ROW_SECONDS defaults to 300);
#   tests  the tpu-marked tests under TEST_PATHS (default packages) in one process (one program at a time
#          can hold the chip); TEST_ARGS adds pytest options;
#   cmd    the shell command in CMD (CMD_SECONDS, default 300) with this environment ($PY is the Python),
#          e.g. CMD='$PY -m recir.dlrmv3 parity --target tpu --matmul_precision high';
#   xla    where XLA's compile of a full-size step goes (benchmarks/xla_compile.py; XLA_ARGS, default UIH 64 bf16,
#          one token budget; XLA_SECONDS, default 300);
#   rss    the host memory (VmRSS, getrusage's peak) after each start-up step: JAX's import, its TPU client
#          (jax.devices()), a first array, torch, torchax, RecIR's lowering, a tiny compiled step (the
#          full-size runs' 16-17 GiB host peak is not attributed yet). Not in the default STAGES.
# Full-size rows' cold compiles on a v5e (2026-12-06): UIH 64 bf16 41-42 s, fp32 185 s (float32 products at
# `highest`); BENCH_SECONDS=480 ran two rows (UIH 64 fp32 and bf16), a third (UIH 256 fp32) did not finish.
# Since the random numbers' optimization barrier (session 39): XLA's compile bf16 34 s, fp32 134 s; where a
# compile goes: STAGES=xla.
# Use: OUT=/some/dir bash benchmarks/tpu_session.sh; keep a call under the device's 10 minutes.
# The wheels, fetched here for that machine's Python 3.11 (see the README's "On a TPU" for the list):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl-tpu fbgemm-gpu-cpu==1.8.0 \
#     torchrec==1.8.0 torchax==0.0.14.dev20261026 tensordict torchmetrics==1.0.3 lightning-utilities tqdm \
#     pyre-extensions typing-inspect mypy-extensions pyvers cloudpickle tensorboard tensorboard-data-server \
#     markdown werkzeug grpcio protobuf absl-py flatbuffers typing-extensions sympy mpmath networkx jinja2 \
#     markupsafe filelock fsspec   # torch's own needs: the 2026-12-06 run carried them (38 MB in all)
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
OUT="${OUT:-$(mktemp -d)}"; mkdir -p "$OUT"
STAGES="${STAGES:-env smoke bench tests}"  # and rss; BENCH_ARGS="... --matmul_precision high" for float32 at three passes
# The machine's JAX belongs to its Python 3.11; a bare python3 there follows this checkout's .python-version (3.12).
PY="${PY:-python3.11}"
SITE=/tmp/site
if [ ! -e "$SITE/.installed" ]; then  # a warm machine keeps /tmp between calls
  el "installing torch (/opt/wheels) and .whl-tpu/*.whl into $SITE"
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" /opt/wheels/torch-*cp311*.whl .whl-tpu/*.whl && touch "$SITE/.installed" \
    || { echo "WHEEL INSTALL FAILED"; exit 1; }
fi
# The machine's JAX first, then the carried wheels; RecIR's sources before both.
export PYTHONPATH="$(ls -d "$PWD"/packages/*/src | paste -sd:):${PYTHONPATH:-}:$SITE"
export RECIR_CACHE_DIR="${RECIR_CACHE_DIR:-/tmp/recir-cache}"
has() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }

if has env; then
  el "env"
  "$PY" - <<'PY' 2>&1 | tee "$OUT/env.txt"
import platform, sys
import jax, torch
print("python", sys.version.split()[0], platform.libc_ver(), "torch", torch.__version__, "jax", jax.__version__)
print("devices", jax.devices())
for mod in ("torchax", "torchrec", "fbgemm_gpu", "pytest"):
    try:
        m = __import__(mod); print(mod, getattr(m, "__version__", "present"))
    except Exception as e:
        print(mod, "missing:", type(e).__name__, str(e)[:200])
import recir.lower_tpu, recir.dlrmv3  # noqa: F401  (the stack checks run at import)
print("recir imports ok")
PY
fi
if has smoke; then
  el "smoke: 6 steps of DLRMv3 through the TPU trainer"
  timeout 240 "$PY" -m recir.examples.dlrmv3.tpu.train --dataset debug --batch_size 4 --num_workers 0 \
    --num_train_batches 6 --embedding_dim 64 --num_layers 1 --uih_len 16 --num_candidates 4 --hash_size 1000 \
    --embedding_backend in_graph --log_every 1 2>&1 | tee "$OUT/smoke.log" | tail -15
fi
if has bench; then
  el "bench: benchmarks/dlrmv3.py ${BENCH_ARGS:---configs 64,256 --token_buckets 1}"
  # shellcheck disable=SC2086
  timeout "${BENCH_SECONDS:-540}" "$PY" benchmarks/dlrmv3.py --targets tpu --timeout "${ROW_SECONDS:-300}" \
    ${BENCH_ARGS:---configs 64,256 --token_buckets 1} 2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -30
fi
if has tests; then
  el "tests: tpu-marked, on the chip"
  # shellcheck disable=SC2086
  timeout "${TEST_SECONDS:-300}" "$PY" -m pytest ${TEST_PATHS:-packages} -m tpu -q -p no:cacheprovider -rfE ${TEST_ARGS:-} \
    2>&1 | tee "$OUT/tpu-tests.log" | tail -40
fi
if has cmd; then
  el "cmd: ${CMD:-}"
  export PY
  timeout "${CMD_SECONDS:-300}" bash -c "${CMD:-true}" 2>&1 | tee "$OUT/cmd.log" | tail -60
fi
if has xla; then
  el "xla: benchmarks/xla_compile.py ${XLA_ARGS:---uih 64 --precision bf16 -- --token_buckets 1}"
  # shellcheck disable=SC2086
  timeout "${XLA_SECONDS:-300}" "$PY" benchmarks/xla_compile.py ${XLA_ARGS:---uih 64 --precision bf16 -- --token_buckets 1} \
    2>&1 | tee "$OUT/xla.log" | grep -v "^\s*$" | tail -50
fi
if has rss; then
  el "rss: host memory after each start-up step"
  timeout "${RSS_SECONDS:-240}" "$PY" - <<'PY' 2>&1 | tee "$OUT/rss.txt"
import resource
import time

T0 = time.perf_counter()


def rss(what):
    # the TPU machine's /proc/self/status has VmRSS but no VmHWM (2026-12-06): the peak is getrusage's
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    now = int(status["VmRSS"].split()[0]) / 2**20 if "VmRSS" in status else float("nan")  # kB -> GiB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux
    print(f"rss {what:<28} now {now:6.2f} GiB  peak {peak:6.2f} GiB  at {time.perf_counter() - T0:5.1f} s", flush=True)


rss("start")
import jax

rss("import jax")
devices = jax.devices()
rss(f"jax.devices() ({devices[0].platform})")
jax.numpy.ones((1024, 1024)).block_until_ready()
rss("a first array")
import torch

rss("import torch")
import torchax  # noqa: F401

rss("import torchax")
import recir.lower_tpu as lt

rss("import recir.lower_tpu")
from recir.capture import capture_train_step

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters())
batch = {"x": torch.randn(32, 64), "y": torch.randn(32, 1)}
loss = lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"])  # noqa: E731
step = lt.compile(capture_train_step(model, opt, loss, batch), options=lt.TPUOptions(persistent_cache=False))
state = step.init_state(model, opt)
state, out = step(state, batch)
rss("a tiny compiled step")
PY
fi
el "done"
