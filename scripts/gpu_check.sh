#!/usr/bin/env bash
# The GPU checks of a machine that has torch, transformers and nvcc but no network and no
# checkpoint: run from the repository root, one stage per command (each well under 10 minutes on
# an H100), results under $OUT (default ./gpu-out).
#
#   bash scripts/gpu_check.sh tests     # build the CUDA kernels, run every CUDA test (junit XML + log)
#   bash scripts/gpu_check.sh forward   # bench/device_forward.py: forward time vs the HBM limit
#   bash scripts/gpu_check.sh e2e       # swiftspec bench on random weights, the shipped acceptance trace
#   bash scripts/gpu_check.sh all       # the three in one command of at most BUDGET seconds (default
#                                       # 570), each stage stopped at its share (e2e: PROMPTS 1,
#                                       # SYSTEMS autoregressive swiftspec-serial unless set)
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
  forward)  # the engine's KV cache (max_model_len 4096 + bs 8 slots): its graphs' padded masks
    "$PY" bench/device_forward.py --device cuda --capacity 4104 --out "$OUT/device-forward.json" "${@:2}" 2>&1 \
        | tee "$OUT/forward.log" ;;
  e2e)
    # random weights of the default pair's shapes (bf16, built into $SWIFTSPEC_CACHE on first use);
    # every SwiftSpec mode replays the default pair's recorded acceptance
    NAME=${NAME:-e2e}
    # shellcheck disable=SC2086  # SYSTEMS is a list of words
    "$PY" -m swiftspec bench --device cuda --random-weights --num-prompts "${PROMPTS:-2}" --max-tokens 128 \
        --systems ${SYSTEMS:-autoregressive swiftspec-colocated swiftspec-serial hf hf-compile} \
        --out "$OUT/$NAME" "${@:2}" 2>&1 | tee "$OUT/$NAME.log" ;;
  all)
    # one lease, one call: every stage bounded by the time left, so a hang or a slow stage costs
    # only its share and the results so far come back (run 35's stages took about 140 s with the kernel build, 35 s and 28 s
    # on an H200)
    start=$(date +%s)
    left() { local l=$(( $1 * ${BUDGET:-570} / 570 - ($(date +%s) - start) )); echo $(( l < 5 ? 5 : l )); }
    set +e
    timeout "$(left 280)" bash "$0" tests
    timeout "$(left 400)" bash "$0" forward --rows 1 8 --rounds 10
    PROMPTS=${PROMPTS:-1} SYSTEMS=${SYSTEMS:-autoregressive swiftspec-serial} timeout "$(left 570)" bash "$0" e2e ;;
  *)
    echo "usage: bash scripts/gpu_check.sh tests|forward|e2e|all" >&2; exit 2 ;;
esac
