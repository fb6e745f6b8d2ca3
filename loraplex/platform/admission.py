"""Per-tenant admission in front of the engine: ``max_concurrent_requests`` engine requests
of a tenant at once, at most ``max_queued_requests`` more waiting here (else 429 with
``Retry-After``), none waiting longer than ``max_queue_time_s`` (else 503 with
``Retry-After``; the engine enforces the rest of the same deadline until the request's first
scheduling step, see :class:`~loraplex.platform.async_engine.AsyncEngine`).

Which waiting request of which tenant runs first is the engine's fair scheduler's job; this
gate only bounds how much one tenant may hold and queue. One engine request = one prompt of
an API request. The clock is injectable (``clock``, seconds), so tests advance time
explicitly and call :meth:`TenantAdmission.expire`; the server also schedules ``expire`` at
each waiter's deadline on the event loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.platform.errors import QueueTimedOut, RateLimited
from loraplex.platform.schemas import TenantContext


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future
    deadline: float | None


@dataclass
class _TenantQueue:
    name: str
    active: int = 0
    waiters: deque[_Waiter] = field(default_factory=deque)


@dataclass(frozen=True)
class AdmissionTicket:
    """One admitted engine request of ``tenant_id``; ``deadline`` (clock seconds) bounds its wait
    until the first scheduling step (``None``: unbounded); ``waited_s`` was spent at the gate."""

    tenant_id: int
    deadline: float | None
    waited_s: float


def retry_after_s(tenant: TenantContext) -> int:
    """Seconds a refused client should wait: the tenant's queue time (or 1 s), rounded up."""
    return max(1, math.ceil(tenant.max_queue_time_s or 1.0))


class TenantAdmission:
    """See the module docstring. Event-loop side only (not thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._queues: dict[int, _TenantQueue] = {}

    async def acquire(self, tenant: TenantContext) -> AdmissionTicket:
        """Wait for one of the tenant's concurrent slots.

        Raises:
            RateLimited: 429, the tenant already has ``max_queued_requests`` waiting.
            QueueTimedOut: 503, ``max_queue_time_s`` passed while waiting here.
        """
        start = self.clock()
        deadline = start + tenant.max_queue_time_s if tenant.max_queue_time_s is not None else None
        queue = self._queues.setdefault(tenant.tenant_id, _TenantQueue(tenant.tenant_name))
        limit = tenant.max_concurrent_requests
        if limit is None or (queue.active < limit and not queue.waiters):
            queue.active += 1
            return AdmissionTicket(tenant.tenant_id, deadline, 0.0)
        if tenant.max_queued_requests is not None and len(queue.waiters) >= tenant.max_queued_requests:
            raise RateLimited(f"tenant {tenant.tenant_name!r} already has {len(queue.waiters)} requests queued "
                              f"(max_queued_requests={tenant.max_queued_requests}) behind "
                              f"{queue.active} running (max_concurrent_requests={limit})",
                              retry_after_s=retry_after_s(tenant))
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), deadline)
        queue.waiters.append(waiter)
        if deadline is not None:
            loop.call_later(max(0.0, deadline - start), self.expire)
        try:
            await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                self.release(tenant.tenant_id)  # the slot was handed over as we were cancelled
            elif waiter in queue.waiters:
                queue.waiters.remove(waiter)
            raise
        except QueueTimedOut as exc:
            raise QueueTimedOut(f"tenant {tenant.tenant_name!r}: {exc.message}",
                                retry_after_s=retry_after_s(tenant)) from None
        return AdmissionTicket(tenant.tenant_id, deadline, self.clock() - start)

    def release(self, tenant_id: int) -> None:
        """An admitted engine request finished (or failed): its slot goes to the oldest waiter."""
        queue = self._queues.get(tenant_id)
        if queue is None:
            return
        while queue.waiters:
            waiter = queue.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_result(None)  # the slot moves to it: ``active`` is unchanged
                return
        queue.active -= 1
        if not queue.active:
            del self._queues[tenant_id]

    def expire(self) -> int:
        """Fail the waiters whose deadline has passed (503); returns how many."""
        now = self.clock()
        expired = 0
        for queue in self._queues.values():
            for waiter in [w for w in queue.waiters if w.deadline is not None and w.deadline <= now]:
                queue.waiters.remove(waiter)
                if not waiter.future.done():
                    waiter.future.set_exception(QueueTimedOut("waited longer than max_queue_time_s before "
                                                              "being scheduled", retry_after_s=1))
                    expired += 1
        return expired

    def queue_lengths(self) -> dict[str, int]:
        """Requests waiting at the gate per tenant name (only tenants with some)."""
        return {q.name: len(q.waiters) for q in self._queues.values() if q.waiters}

    def active_by_name(self) -> dict[str, int]:
        """Admitted (in the engine) requests per tenant name (only tenants with some)."""
        return {q.name: q.active for q in self._queues.values() if q.active}

    def active(self, tenant_id: int) -> int:
        queue = self._queues.get(tenant_id)
        return queue.active if queue else 0
