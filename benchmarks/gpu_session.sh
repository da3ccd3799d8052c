#!/usr/bin/env bash
# One prepared GPU check for a machine with its own torch and no package index (how the H200 run in the
# README was made): the gpu-marked tests beside the full-size DLRMv3 benchmark on CUDA, on separate CPU
# cores, logs under $OUT. Missing packages travel as wheels in .whl/ (torchrec, fbgemm-gpu-cpu or
# fbgemm-gpu built for that torch, tensordict, pyvers, iopath); see the README's "From a preinstalled
# stack". Keep it under 9 minutes: BENCH_SECONDS bounds the benchmark, ROW_SECONDS each row. The GPU-path rows
# compile one step per token budget (TOKEN_BUCKETS, default 1 here: 4 budgets' cold compiles of the full-size
# step took over 170 s on the H200 machine's CPU, beside the tests).
# Use: OUT=/some/dir bash benchmarks/gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
OUT="${OUT:-$(mktemp -d)}"; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || echo "WHEEL INSTALL FAILED"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(ls -d packages/*/src | paste -sd:):${PYTHONPATH:-}"
export RECIR_CACHE_DIR="${RECIR_CACHE_DIR:-/tmp/recir-cache}"
python3 - <<'PY' 2>&1 | grep -v "fbgemm_torch_compat\|cannot determine compat\|^WARNING:root\|^\s*$" | tee "$OUT/env.txt"
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
for mod in ("jax", "torchax", "torchrec", "fbgemm_gpu", "triton"):
    try:
        m = __import__(mod); print(mod, getattr(m, "__version__", "present"))
    except Exception as e:
        print(mod, "missing:", type(e).__name__, str(e)[:120])
from recir.embedding._ops import fbgemm_has_cuda
print("fbgemm CUDA kernels:", fbgemm_has_cuda())
PY
PIN_A=""; PIN_B=""
if command -v taskset >/dev/null && [ "$(nproc)" -ge 8 ]; then
  half=$(( $(nproc) / 2 )); PIN_A="taskset -c 0-$((half - 1))"; PIN_B="taskset -c $half-$(( $(nproc) - 1 ))"
fi
(
  el "tests: gpu-marked (capture, lower-gpu, embedding, dlrmv3)"
  timeout 240 $PIN_B python3 -m pytest packages/recir-capture packages/recir-lower-gpu packages/recir-embedding \
    packages/recir-dlrmv3 -m gpu -q -p no:cacheprovider -rA 2>&1 | tee "$OUT/gpu-tests.log" \
    | grep -E "^(PASSED|FAILED|SKIPPED|ERROR)| passed| failed" | tail -30
  el "tests done"
) > "$OUT/tests.log" 2>&1 &
TESTS=$!
el "benchmark: full-size DLRMv3 on CUDA"
timeout "${BENCH_SECONDS:-420}" $PIN_A python3 benchmarks/dlrmv3.py --device cuda --configs "${CONFIGS:-1024}" \
  --batch_size "${BATCH:-32}" --targets "${TARGETS:-eager,gpu,gpu+graphs,torch.compile}" --precisions bf16,fp32 \
  --threads 4 --rounds 3 --steps 5 --warmup 2 --timeout "${ROW_SECONDS:-170}" --token_buckets "${TOKEN_BUCKETS:-1}" \
  2>&1 | tee "$OUT/bench.log"
wait $TESTS
cat "$OUT/tests.log"
el "done"
