"""Usage accounting off the response path: :class:`UsageWriter`.

Serving calls :meth:`UsageWriter.add` (never blocks, never touches the database); a
daemon thread adds the buffered counts to the registry's ``usage_counters``. The buffer
sums counts per (tenant, UTC day), so it holds at most ``max_entries`` rows however many
requests arrive. When a write fails (database down), the rows stay buffered and the
writer retries with exponential backoff (``retry_min_s`` doubling up to ``retry_max_s``);
a row is dropped and logged as lost only when it has waited ``give_up_s`` without being
written, when its tenant no longer exists, or when the buffer is full (a new (tenant, day)
row while ``max_entries`` are waiting). ``lost`` counts what was dropped.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform import crud
from loraplex.platform.db import session_scope
from loraplex.platform.models import utcnow

logger = logging.getLogger(__name__)


@dataclass
class UsageRow:
    """Counts waiting to be added to one tenant's counters of one day."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_added_s: float = 0.0


@dataclass
class UsageLost:
    """What the writer dropped (and logged): rows and the counts in them."""

    rows: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class UsageWriter:
    """Buffered, retried writer of per-tenant usage counters (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], *, max_entries: int = 10_000, retry_min_s: float = 0.5,
                 retry_max_s: float = 30.0, give_up_s: float = 3600.0, background: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``background=False``: no writer thread (only :meth:`flush` writes; for tests and tools)."""
        self._sessions = sessions
        self.max_entries = max_entries
        self.retry_min_s = retry_min_s
        self.retry_max_s = retry_max_s
        self.give_up_s = give_up_s
        self._clock = clock
        self._rows: dict[tuple[int, dt.date], UsageRow] = {}
        self._writing: set[tuple[int, dt.date]] = set()  # rows taken by the flush in progress
        self._lock = threading.Lock()  # guards _rows and lost
        self._write_lock = threading.Lock()  # one writer at a time (thread or flush())
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = not background
        self.lost = UsageLost()
        self.last_error: str | None = None

    # -- producer side -------------------------------------------------------------------------
    def add(self, tenant_id: int, *, requests: int, prompt_tokens: int, completion_tokens: int) -> None:
        """Buffer one request's usage for today (UTC); starts the writer thread on first use."""
        key = (tenant_id, utcnow().date())
        with self._lock:
            row = self._rows.get(key)
            if row is None:
                if len(self._rows) >= self.max_entries:
                    self._drop(key, UsageRow(requests, prompt_tokens, completion_tokens), "the buffer is full")
                    return
                row = self._rows[key] = UsageRow(first_added_s=self._clock())
            row.requests += requests
            row.prompt_tokens += prompt_tokens
            row.completion_tokens += completion_tokens
            self._ensure_thread()
            self._wake.notify()

    def pending(self) -> int:
        """Rows (tenant, day) waiting to be written (buffered or being written now)."""
        with self._lock:
            return len(self._rows.keys() | self._writing)

    # -- writer side ---------------------------------------------------------------------------
    def flush(self) -> bool:
        """Try to write every buffered row now (in the calling thread). True when no row taken in
        this pass is kept for a retry (written, or dropped past ``give_up_s``); rows added
        meanwhile wait for the next pass and are not a failure."""
        with self._write_lock:
            with self._lock:
                batch, self._rows = self._rows, {}
                self._writing = set(batch)
            failed: dict[tuple[int, dt.date], UsageRow] = {}
            for key, row in batch.items():
                outcome = self._write(key, row)
                if outcome == "retry":
                    failed[key] = row
            with self._lock:
                self._writing = set()
                now = self._clock()
                kept = 0
                for key, row in failed.items():
                    if now - row.first_added_s >= self.give_up_s:
                        self._drop(key, row, f"not written for {self.give_up_s:.0f} s ({self.last_error})")
                        continue
                    kept += 1
                    merged = self._rows.setdefault(key, UsageRow(first_added_s=row.first_added_s))
                    merged.requests += row.requests
                    merged.prompt_tokens += row.prompt_tokens
                    merged.completion_tokens += row.completion_tokens
                    merged.first_added_s = min(merged.first_added_s, row.first_added_s)
                return kept == 0

    def _write(self, key: tuple[int, dt.date], row: UsageRow) -> str:
        """"ok", "gone" (tenant deleted: dropped) or "retry" (database error)."""
        tenant_id, day = key
        for _ in range(3):  # the first insert of a (tenant, day) row can race another writer
            try:
                with session_scope(self._sessions) as session:
                    crud.record_usage(session=session, tenant_id=tenant_id, requests=row.requests,
                                      prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens,
                                      day=day)
                return "ok"
            except IntegrityError:  # lost the race (or the tenant was just deleted): retry as an update
                continue
            except Exception as exc:  # noqa: BLE001 - the database is unreachable: keep the row
                self.last_error = type(exc).__name__
                logger.debug("usage write failed", exc_info=True)
                return "retry"
        with self._lock:
            self._drop(key, row, "the tenant is gone")
        return "gone"

    def _drop(self, key: tuple[int, dt.date], row: UsageRow, why: str) -> None:
        self.lost.rows += 1
        self.lost.requests += row.requests
        self.lost.prompt_tokens += row.prompt_tokens
        self.lost.completion_tokens += row.completion_tokens
        logger.error("usage of tenant %d on %s lost (%d requests, %d prompt + %d completion tokens): %s",
                     key[0], key[1], row.requests, row.prompt_tokens, row.completion_tokens, why)

    def _ensure_thread(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="loraplex-usage-writer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        delay = self.retry_min_s
        while True:
            with self._lock:
                while not self._rows and not self._stopping:
                    self._wake.wait()
                if self._stopping:
                    return
            if self.flush():
                delay = self.retry_min_s
                continue
            logger.warning("usage not written (%s): %d rows buffered, retrying in %.1f s",
                           self.last_error, self.pending(), delay)
            with self._lock:
                self._wake.wait_for(lambda: self._stopping, timeout=delay)
                if self._stopping:
                    return
            delay = min(delay * 2, self.retry_max_s)

    def close(self) -> None:
        """Stop the thread, try a last write, and log what is still buffered as lost."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(30)
        if not self.flush():
            with self._lock:
                rows, self._rows = self._rows, {}
                for key, row in rows.items():
                    self._drop(key, row, f"the server stopped while the registry was unreachable "
                                         f"({self.last_error})")
