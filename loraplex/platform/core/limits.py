"""A concurrency limit shared by every caller of one platform process."""

from __future__ import annotations

import asyncio
import threading
import weakref


class SharedLimit:
    """At most ``limit`` holders at a time, whichever request or console callback asks.

    ``asyncio.Semaphore`` binds to the event loop that first waits on it, so each loop gets
    its own semaphore of ``limit`` (the server runs one loop: the API and the mounted
    console share it; tests may run several). Use: ``async with shared.semaphore(): ...``.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"SharedLimit: limit={limit!r} must be >= 1")
        self.limit = limit
        self._lock = threading.Lock()
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())

    def semaphore(self) -> asyncio.Semaphore:
        """The running loop's semaphore. Raises ``RuntimeError`` outside a running loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            semaphore = self._by_loop.get(loop)
            if semaphore is None:
                semaphore = self._by_loop[loop] = asyncio.Semaphore(self.limit)
            return semaphore
