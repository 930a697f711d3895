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
if [ ! -f "$stamp" ]; then
  $py -m pip install -q --upgrade pip
  if ! $py -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then
      $py -m pip install -q torch
    else
      $py -m pip install -q torch==2.13.0
    fi
  fi
  $py -m pip install -q -e ".${1:+[$1]}"
  touch "$stamp"
fi
