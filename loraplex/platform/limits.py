"""Per-tenant rate limits: ``requests_per_minute`` and ``tokens_per_minute`` over fixed
one-minute windows (UTC minute boundaries), enforced by reservation.

Admission (:meth:`RateLimiter.admit`) reserves, in one atomic step of the store (a Lua
script in Redis, a lock in-process), both

- ``completions`` = prompts x ``n`` against ``requests_per_minute``, and
- ``tokens`` = prompt tokens + ``max_tokens`` per completion against ``tokens_per_minute``,

and refuses the request (429, ``Retry-After`` = seconds to the next window) without
changing either counter when one of them would go over its limit. So concurrent requests
can never overshoot a limit. When the request ends, :meth:`RateLimiter.settle` gives back
the reserved tokens it did not use (in the window where they were reserved). A request
that could never fit (more completions or tokens than the whole per-minute limit) gets
400 ``request_too_large`` instead of a 429 that retrying cannot cure.

Own code rather than the ``limits`` library: that library's ``hit(cost)`` checks one
limit at a time (no atomic check of two limits together), cannot give tokens back, and
has no fallback that carries a window's count across a Redis outage; the store
(:mod:`loraplex.platform.cache`) provides those three.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loraplex.platform.cache import NAMESPACE, Store
from loraplex.platform.errors import InvalidRequest, RateLimited


@dataclass(frozen=True)
class Admission:
    """What :meth:`RateLimiter.admit` reserved for one request (settle it exactly once)."""

    tenant_id: int
    window_start_s: int
    completions: int
    reserved_tokens: int


def reserved_tokens(prompt_lens: Sequence[int], *, n: int, max_tokens: int | None, max_model_len: int) -> int:
    """Tokens a request may use at most: every prompt once plus ``max_tokens`` per completion
    (without ``max_tokens``: up to ``max_model_len`` per completion)."""
    return sum(length + n * (max_tokens if max_tokens is not None else max(0, max_model_len - length))
               for length in prompt_lens)


class RateLimiter:
    """Reservation-based per-tenant limits (see the module docstring); ``clock`` = wall seconds."""

    WINDOW_S = 60

    def __init__(self, store: Store, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self._clock = clock

    def _window(self) -> tuple[int, int]:
        """(start of the current window in epoch seconds, whole seconds until the next one >= 1)."""
        now = self._clock()
        start = int(now // self.WINDOW_S) * self.WINDOW_S
        return start, max(1, int(start + self.WINDOW_S - now + 0.999))

    def _keys(self, tenant_id: int, start: int) -> tuple[str, str]:
        return f"{NAMESPACE}rl:{tenant_id}:req:{start}", f"{NAMESPACE}rl:{tenant_id}:tok:{start}"

    def admit(self, *, tenant_id: int, requests_per_minute: int | None, tokens_per_minute: int | None,
              completions: int, tokens: int) -> Admission:
        """Reserve ``completions`` and ``tokens`` in the current window.

        Raises ``InvalidRequest`` (400, code ``request_too_large``) when the request alone is over
        a limit, ``RateLimited`` (429 with ``retry_after_s``) when the window has no room left.
        """
        if requests_per_minute is not None and completions > requests_per_minute:
            raise InvalidRequest(
                f"This request asks for {completions} completions (prompts x n) but requests_per_minute="
                f"{requests_per_minute} counts completions: send fewer prompts or a smaller n.",
                param="n", code="request_too_large")
        if tokens_per_minute is not None and tokens > tokens_per_minute:
            raise InvalidRequest(
                f"This request may use {tokens} tokens (prompt tokens + max_tokens per completion) but "
                f"tokens_per_minute={tokens_per_minute}: lower max_tokens, n or the prompt.",
                param="max_tokens", code="request_too_large")
        start, retry_after_s = self._window()
        req_key, tok_key = self._keys(tenant_id, start)
        result = self.store.reserve([req_key, tok_key], [completions, tokens],
                                    [requests_per_minute, tokens_per_minute], self.WINDOW_S * 2)
        if not result.admitted:
            used_requests, used_tokens = result.values
            if requests_per_minute is not None and used_requests + completions > requests_per_minute:
                raise RateLimited(f"Rate limit reached: requests_per_minute={requests_per_minute} (used "
                                  f"{used_requests} completions, this request needs {completions}); retry in "
                                  f"{retry_after_s} s.", retry_after_s=retry_after_s)
            raise RateLimited(f"Rate limit reached: tokens_per_minute={tokens_per_minute} (used or reserved "
                              f"{used_tokens}, this request may use {tokens}); retry in {retry_after_s} s.",
                              retry_after_s=retry_after_s)
        return Admission(tenant_id, start, completions, tokens)

    def settle(self, admission: Admission, used_tokens: int) -> None:
        """Give back the reserved tokens ``admission`` did not use (or charge any it used beyond)."""
        delta = used_tokens - admission.reserved_tokens
        if delta:
            _, tok_key = self._keys(admission.tenant_id, admission.window_start_s)
            self.store.incr(tok_key, delta, self.WINDOW_S * 2)

    def charge(self, *, tenant_id: int, tokens: int) -> None:
        """Charge ``tokens`` used without an admission to the current window."""
        start, _ = self._window()
        self.store.incr(self._keys(tenant_id, start)[1], tokens, self.WINDOW_S * 2)

    def used(self, tenant_id: int) -> tuple[int, int]:
        """(completions, tokens) counted in the current window (reserved tokens included)."""
        start, _ = self._window()
        req_key, tok_key = self._keys(tenant_id, start)
        return int(self.store.get(req_key) or 0), int(self.store.get(tok_key) or 0)
