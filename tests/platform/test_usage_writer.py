"""The usage writer (issue 14, item 3): usage buffered while the registry is unreachable,
written once it answers, and lost (counted and logged) only after ``give_up_s``, when the
buffer is full, or when the tenant is gone. Clock injected; no writer thread."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from loraplex.platform import crud
from loraplex.platform.db import make_db_engine, make_session_factory, upgrade_database
from loraplex.platform.usage import UsageWriter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Outage:
    """A session factory that fails like an unreachable database while ``down``."""

    def __init__(self, sessions) -> None:
        self.sessions = sessions
        self.down = False

    def __call__(self):
        if self.down:
            raise OperationalError("connect", {}, ConnectionRefusedError("connection refused (port 5432)"))
        return self.sessions()


@pytest.fixture
def registry(tmp_path):
    db = make_db_engine(f"sqlite:///{tmp_path / 'r.db'}")
    upgrade_database(db)
    sessions = make_session_factory(db)
    with sessions() as session:
        ids = [crud.create_tenant(session=session, name=n, requests_per_minute=None, tokens_per_minute=None,
                                  max_adapters=1, max_upload_mb=1.0).id for n in ("acme", "globex")]
        session.commit()
    yield sessions, ids
    db.dispose()


def totals(sessions) -> dict[str, tuple[int, int, int]]:
    with sessions() as session:
        return {name: (r, p, c) for name, r, p, c in crud.usage_by_tenant(session=session)}


def test_usage_is_kept_through_an_outage_and_written_after(registry):
    sessions, (acme, _) = registry
    outage, clock = Outage(sessions), Clock()
    writer = UsageWriter(outage, give_up_s=3600, background=False, clock=clock)
    writer.add(acme, requests=1, prompt_tokens=5, completion_tokens=3)
    assert writer.flush() and totals(sessions)["acme"] == (1, 5, 3)
    outage.down = True
    for _ in range(3):
        writer.add(acme, requests=1, prompt_tokens=5, completion_tokens=3)
    assert writer.flush() is False and writer.pending() == 1  # summed into one (tenant, day) row
    clock.now += 3599
    assert writer.flush() is False and writer.lost.rows == 0
    outage.down = False
    assert writer.flush() is True
    assert totals(sessions)["acme"] == (4, 20, 12) and writer.lost.requests == 0


def test_usage_is_lost_and_logged_only_after_give_up_s(registry, caplog):
    sessions, (acme, _) = registry
    outage, clock = Outage(sessions), Clock()
    writer = UsageWriter(outage, give_up_s=3600, background=False, clock=clock)
    outage.down = True
    writer.add(acme, requests=2, prompt_tokens=10, completion_tokens=4)
    assert writer.flush() is False
    clock.now += 3600
    with caplog.at_level(logging.ERROR, logger="loraplex.platform.usage"):
        assert writer.flush() is True  # nothing left: dropped
    assert (writer.lost.rows, writer.lost.requests, writer.lost.prompt_tokens) == (1, 2, 10)
    assert "lost (2 requests, 10 prompt + 4 completion tokens)" in caplog.text
    assert "5432" not in caplog.text  # the driver text is not repeated in the loss line


def test_a_full_buffer_and_a_deleted_tenant_lose_only_their_rows(registry):
    sessions, (acme, globex) = registry
    outage = Outage(sessions)
    writer = UsageWriter(outage, max_entries=1, background=False, clock=Clock())
    outage.down = True
    writer.add(acme, requests=1, prompt_tokens=1, completion_tokens=1)
    writer.add(globex, requests=1, prompt_tokens=7, completion_tokens=1)  # a second row: the buffer is full
    writer.add(acme, requests=1, prompt_tokens=1, completion_tokens=1)  # same row: still fits
    assert (writer.lost.rows, writer.lost.prompt_tokens) == (1, 7)
    outage.down = False
    assert writer.flush() and totals(sessions)["acme"] == (2, 2, 2)
    gone = UsageWriter(sessions, background=False, clock=Clock())
    gone.add(999, requests=1, prompt_tokens=3, completion_tokens=0)  # no such tenant (foreign key)
    assert gone.flush() is True and gone.lost.rows == 1 and gone.lost.prompt_tokens == 3
    with sessions() as session:
        assert session.scalar(sa.text("SELECT count(*) FROM usage_counters")) == 1
