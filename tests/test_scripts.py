"""scripts/run_tests.sh (``make test``) stops the PostgreSQL cluster it started, and only that one.

The PostgreSQL tools are replaced by stubs on ``PATH`` that record their calls (the real
cluster of this machine is left alone); pytest is replaced by a stub interpreter.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

STUBS = {
    # Columns as Debian's pg_lsclusters: Ver Cluster Port Status Owner ...
    "pg_lsclusters": 'echo "15 main 5432 $(cat "$STUB_DIR/state") postgres /var/lib/postgresql/15/main log"',
    "pg_ctlcluster": 'echo "pg_ctlcluster $*" >> "$STUB_DIR/calls"\n'
                     'case "$3" in start) echo online > "$STUB_DIR/state";; stop) echo down > "$STUB_DIR/state";; esac',
    "pg_isready": "exit 0",
    "psql": "echo 1",
    "runuser": 'shift 3; exec "$@"',
    "fake-python": 'echo "pytest $*" >> "$STUB_DIR/calls"; exit "${STUB_PYTEST_STATUS:-0}"',
}


def run_tests_sh(tmp_path: Path, cluster_state: str, pytest_status: int = 0) -> tuple[int, list[str]]:
    stub_dir = tmp_path / "stubs"
    stub_dir.mkdir()
    for name, body in STUBS.items():
        (stub_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (stub_dir / name).chmod(0o755)
    (stub_dir / "state").write_text(cluster_state + "\n")
    env = {k: v for k, v in os.environ.items() if k != "LORAPLEX_TEST_DATABASE_URL"}
    env.update(PATH=f"{stub_dir}:{env['PATH']}", STUB_DIR=str(stub_dir), PYTHON=str(stub_dir / "fake-python"),
               STUB_PYTEST_STATUS=str(pytest_status))
    proc = subprocess.run(["bash", "scripts/run_tests.sh", "tests/x.py"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    calls = (stub_dir / "calls").read_text().splitlines()
    return proc.returncode, [c.split(" -- ")[0] for c in calls]


@pytest.mark.parametrize("pytest_status", [0, 3])
def test_stops_the_cluster_it_started(tmp_path, pytest_status):
    status, calls = run_tests_sh(tmp_path, "down", pytest_status)
    assert status == pytest_status
    assert calls == ["pg_ctlcluster 15 main start",
                     "pytest -m pytest -q -p no:cacheprovider --durations=25 tests/x.py",
                     "pg_ctlcluster 15 main stop"]


def test_leaves_a_running_cluster_running(tmp_path):
    status, calls = run_tests_sh(tmp_path, "online")
    assert status == 0
    assert calls == ["pytest -m pytest -q -p no:cacheprovider --durations=25 tests/x.py"]
