#!/usr/bin/env bash
# Create .venv at the repository root (if missing) and install SwiftSpec into it.
# CPU machines get torch 2.13.0's CPU build; a plain `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
stamp=.venv/.swiftspec-installed-$(cat setup.py pyproject.toml | sha256sum | cut -c1-16)${1:+-$1}
log=.venv/install.log
quiet() { "$@" >>"$log" 2>&1 || { cat "$log" >&2; echo "setup failed: $*" >&2; exit 1; }; }
if [ ! -f "$stamp" ]; then
  echo "setting up .venv (log: $log)" >&2
  quiet $py -m pip install --upgrade pip
  if ! $py -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      quiet $py -m pip install torch
    else
      quiet $py -m pip install torch==2.13.0
    fi
  fi
  # The test and bench extras build llama-cpp-python (the llama.cpp peer) from source: -march=native,
  # its AMX matmul compiled out, as it segfaults on some AMX CPUs, and no multimodal library (the
  # peers are text only) (LLAMA_CPP_CMAKE_ARGS in swiftspec/benchmark/peers.py; a CMAKE_ARGS of your
  # own wins).
  export CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_C_FLAGS=-U__AMX_INT8__ -DCMAKE_CXX_FLAGS=-U__AMX_INT8__ -DLLAVA_BUILD=OFF}"
  quiet $py -m pip install -e ".${1:+[$1]}"
  touch "$stamp"
fi
# Compile the CPU kernels now rather than inside the first engine start (a no-op when up to date).
if ! $py -m swiftspec.ops.cpu >>"$log" 2>&1; then
  echo "warning: the CPU kernels did not build (see $log); SwiftSpec falls back to PyTorch ops" >&2
fi
