#!/usr/bin/env bash
# The GPU checks of a machine that has torch, transformers and nvcc but no network and no
# checkpoint: run from the repository root, one stage per command (each well under 10 minutes on
# an H100), results under $OUT (default ./gpu-out).
#
#   bash scripts/gpu_check.sh tests     # build the CUDA kernels, run every CUDA test (junit XML + log)
#   bash scripts/gpu_check.sh forward   # bench/device_forward.py: forward time vs the read bandwidth
#   bash scripts/gpu_check.sh e2e       # swiftspec bench on random weights, the shipped acceptance trace
#   bash scripts/gpu_check.sh all       # every stage in one call: scripts/gpu_check.py (tests, step
#                                       # breakdown of the big shapes, e2e with the p sweep, the
#                                       # multi-process probes and runs), each within its budget
#
# Extra arguments go to pytest (tests) or to swiftspec bench (e2e); for e2e, SYSTEMS replaces the
# systems, NAME the output folder and log's name ($OUT/<NAME>/, default e2e), PROMPTS the prompts
# per dataset (default 2).
#
# Nothing is installed: the package runs from this checkout (PYTHONPATH), gguf is not needed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SWIFTSPEC_CACHE=${SWIFTSPEC_CACHE:-$PWD/.cache-gpu}
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.csv" 2>&1 || true
case "${1:-}" in
  tests)
    "$PY" -m pytest -q -rs tests/test_cuda_build.py tests/test_cuda_kernels.py tests/test_graphs.py \
        tests/test_cuda_engine.py --junitxml "$OUT/cuda-tests.xml" --durations 15 "${@:2}" 2>&1 | tee "$OUT/cuda-tests.log" ;;
  forward)  # the engine's KV cache (max_model_len 4096 + bs 8 slots): its graphs' padded masks; --models NAME...
    "$PY" bench/device_forward.py --device cuda --capacity 4104 --out "$OUT/device-forward.json" "${@:2}" 2>&1 \
        | tee "$OUT/forward.log" ;;
  e2e)
    # random weights made on the GPU (default: the default pair's shapes; --target-config NAME for
    # another shipped one); every SwiftSpec mode replays the default pair's recorded acceptance
    NAME=${NAME:-e2e}
    # shellcheck disable=SC2086  # SYSTEMS is a list of words
    "$PY" -m swiftspec bench --device cuda --random-weights --num-prompts "${PROMPTS:-2}" --max-tokens 128 \
        --systems ${SYSTEMS:-autoregressive swiftspec-colocated swiftspec-serial hf hf-compile} \
        --out "$OUT/$NAME" "${@:2}" 2>&1 | tee "$OUT/$NAME.log" ;;
  all)
    exec "$PY" scripts/gpu_check.py --out "$OUT" "${@:2}" ;;
  *)
    echo "usage: bash scripts/gpu_check.sh tests|forward|e2e|all" >&2; exit 2 ;;
esac
