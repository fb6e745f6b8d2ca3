# Sourced by the gpu_issue*.sh scripts: from the repository root, PYTHONPATH, $OUT (created) and $PY, and
# `run NAME LIMIT_S CMD...`, which runs CMD under `timeout`, its output in $OUT/NAME.log, and prints the log's tail.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=.
OUT=${OUT:-/tmp/loraplex-bench}
mkdir -p "$OUT"
PY=${PY:-python3}

run() {
    local name=$1 limit=$2
    shift 2
    echo "[$(date -u +%T)] $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "[$(date -u +%T)] $name: exit $?"
    tail -n 30 "$OUT/$name.log"
}
