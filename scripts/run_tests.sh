#!/usr/bin/env bash
# The whole test suite, as CI runs it: starts PostgreSQL for the registry tests
# (redis-server processes are started by the tests themselves), then pytest.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export LORAPLEX_CACHE_DIR=${LORAPLEX_CACHE_DIR:-$PWD/.cache}
if [[ -z "${LORAPLEX_TEST_DATABASE_URL:-}" ]]; then
  eval "$(bash scripts/ci_services.sh)"
fi
export LORAPLEX_TEST_DATABASE_URL
# Kernel tests run the Triton kernels in the CPU interpreter.
export TRITON_INTERPRET=1
exec "$PYTHON" -m pytest -q -p no:cacheprovider --durations=25 "$@"
