#!/usr/bin/env bash
# Run the whole test suite: sets up .venv with the test extras, fetches the default model pair
# (once, into $SWIFTSPEC_CACHE or ~/.cache/swiftspec) and runs pytest, real-model tests included.
# Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup_env.sh" test
cd "$root"
export SWIFTSPEC_REAL_MODELS="${SWIFTSPEC_REAL_MODELS:-1}"
exec .venv/bin/python -m pytest -ra "$@"
