#!/usr/bin/env bash
# The whole test suite, as CI runs it: starts PostgreSQL for the registry tests
# (redis-server processes are started by the tests themselves), then pytest, then
# stops PostgreSQL again if it was not running before. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
export LORAPLEX_CACHE_DIR=${LORAPLEX_CACHE_DIR:-$PWD/.cache}
LORAPLEX_PG_STARTED=""
if [[ -z "${LORAPLEX_TEST_DATABASE_URL:-}" ]]; then
  eval "$(bash scripts/ci_services.sh)"
fi
stop_postgres() {
  if [[ -n "$LORAPLEX_PG_STARTED" ]]; then
    echo "run_tests: stopping PostgreSQL cluster $LORAPLEX_PG_STARTED (started for the tests)" >&2
    # shellcheck disable=SC2086 # "<version> <cluster>": two arguments
    pg_ctlcluster $LORAPLEX_PG_STARTED stop >&2 || true
  fi
}
trap stop_postgres EXIT
export LORAPLEX_TEST_DATABASE_URL
# Kernel tests run the Triton kernels in the CPU interpreter.
export TRITON_INTERPRET=1
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=25 "$@"
