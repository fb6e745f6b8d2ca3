#!/usr/bin/env bash
# Start the PostgreSQL server the platform tests use, and print the export line
# for LORAPLEX_TEST_DATABASE_URL (nothing is installed here: Debian's
# `postgresql` package must already be present).
#
#   eval "$(scripts/ci_services.sh)"     # then: python -m pytest tests/platform
#
# Environment (all optional): PGPORT (5432), LORAPLEX_PG_USER / LORAPLEX_PG_PASSWORD
# (loraplex / loraplex), LORAPLEX_PG_DB (loraplex_test). Listens on 127.0.0.1 only.
# Diagnostics go to stderr; stdout is only export lines: LORAPLEX_TEST_DATABASE_URL, and
# LORAPLEX_PG_STARTED="<version> <cluster>" when this script started the cluster (empty when
# it was running already), so that the caller stops only what was started for it:
#   pg_ctlcluster $LORAPLEX_PG_STARTED stop
# Redis is not started here: the tests start their own redis-server processes on free ports.
set -euo pipefail

port="${PGPORT:-5432}"
user="${LORAPLEX_PG_USER:-loraplex}"
password="${LORAPLEX_PG_PASSWORD:-loraplex}"
db="${LORAPLEX_PG_DB:-loraplex_test}"

log() { echo "ci_services: $*" >&2; }

command -v pg_lsclusters >/dev/null || { log "postgresql is not installed (apt-get install postgresql)"; exit 1; }

# The newest installed cluster (Debian creates "main" when the package is installed).
read -r version cluster _ < <(pg_lsclusters --no-header | sort -k1,1n | tail -n 1) || true
if [ -z "${version:-}" ]; then
  version="$(ls /usr/lib/postgresql | sort -n | tail -n 1)"
  cluster=main
  log "creating cluster $version/$cluster"
  pg_createcluster "$version" "$cluster" --port "$port" >&2
fi

started=""
if ! pg_lsclusters --no-header | awk -v v="$version" -v c="$cluster" '$1==v && $2==c {print $4}' | grep -q online; then
  log "starting cluster $version/$cluster"
  started="$version $cluster"
  pg_ctlcluster "$version" "$cluster" start -- -o "-c listen_addresses=127.0.0.1 -c port=$port" >&2 \
    || pg_ctlcluster "$version" "$cluster" start >&2
fi

as_postgres() {
  if [ "$(id -un)" = postgres ]; then "$@"; else runuser -u postgres -- "$@" 2>/dev/null || sudo -u postgres "$@"; fi
}

for _ in $(seq 1 50); do
  as_postgres pg_isready -q -h 127.0.0.1 -p "$port" && break
  sleep 0.2
done
as_postgres pg_isready -q -h 127.0.0.1 -p "$port" || { log "PostgreSQL did not come up on 127.0.0.1:$port"; exit 1; }

psql_admin() { as_postgres psql -v ON_ERROR_STOP=1 -q -p "$port" -d postgres "$@"; }

if [ "$(psql_admin -tAc "SELECT 1 FROM pg_roles WHERE rolname = '$user'")" != 1 ]; then
  log "creating role $user"
  psql_admin -c "CREATE ROLE \"$user\" LOGIN PASSWORD '$password'" >&2
else
  psql_admin -c "ALTER ROLE \"$user\" LOGIN PASSWORD '$password'" >&2
fi
if [ "$(psql_admin -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
  log "creating database $db"
  psql_admin -c "CREATE DATABASE \"$db\" OWNER \"$user\"" >&2
fi
# The tests drop and re-create the public schema: the role must own it.
as_postgres psql -v ON_ERROR_STOP=1 -q -p "$port" -d "$db" -c "ALTER SCHEMA public OWNER TO \"$user\"" >&2

echo "export LORAPLEX_TEST_DATABASE_URL=postgresql+psycopg://$user:$password@127.0.0.1:$port/$db"
echo "export LORAPLEX_PG_STARTED=\"$started\""
