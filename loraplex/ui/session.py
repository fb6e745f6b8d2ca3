"""Who is using the console: the admin, or one tenant.

The key typed at login is kept in the browser session's server-side state
(``gr.State`` never leaves the server) and checked again by every callback
through the platform's own authentication services, so a revoked key or a
deleted tenant loses access at its next click.

A page reload keeps the session for its lifetime (``SESSION_LIFETIME_S``, or until
"Sign out"): :class:`ConsoleSessions` (the one owner of console sessions) hands out a
random token per sign-in, which the browser keeps only as an HttpOnly cookie; the key
itself never leaves the server. The same token opens Gradio's data endpoints (``gate.py``).
Tokens live in the server's memory: a restart signs everyone out.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import NotFound, Unauthenticated
from loraplex.platform.schemas import TenantContext
from loraplex.platform.services import tenants as tenant_service


@dataclass(frozen=True)
class ConsoleSession:
    """``role`` "admin" (every tenant) or "tenant" (``tenant_name`` only)."""

    role: Literal["admin", "tenant"]
    key: str = field(repr=False)
    tenant_name: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def login(ctx: PlatformContext, key: str | None) -> ConsoleSession:
    """The session the key opens: the admin key first, else a tenant API key.

    Raises ``Unauthenticated`` (the platform's message) for an empty, unknown or revoked key.
    """
    token = (key or "").strip()
    if not token:
        raise Unauthenticated("Enter the admin key or a tenant API key.")
    try:
        tenant_service.authenticate_admin(ctx=ctx, token=token)
        return ConsoleSession(role="admin", key=token)
    except Unauthenticated:
        pass
    tenant = tenant_service.authenticate_tenant(ctx=ctx, token=token)
    return ConsoleSession(role="tenant", key=token, tenant_name=tenant.tenant_name)


def check(ctx: PlatformContext, session: ConsoleSession | None) -> ConsoleSession:
    """The session, its key checked again. Raises ``Unauthenticated`` when signed out or revoked."""
    if session is None:
        raise Unauthenticated("Not signed in: enter the admin key or a tenant API key.")
    if session.is_admin:
        tenant_service.authenticate_admin(ctx=ctx, token=session.key)
    else:
        tenant_service.authenticate_tenant(ctx=ctx, token=session.key)
    return session


def require_admin(ctx: PlatformContext, session: ConsoleSession | None) -> ConsoleSession:
    """Raises ``Unauthenticated`` unless the session is the admin's."""
    session = check(ctx, session)
    if not session.is_admin:
        raise Unauthenticated("This page needs the admin key.")
    return session


def acting_tenant(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None) -> TenantContext:
    """The tenant a callback acts for: any tenant for the admin (``NotFound`` if it does not
    exist), the signed-in tenant itself otherwise (``NotFound`` for any other name, as the API)."""
    session = check(ctx, session)
    if session.is_admin:
        if not tenant_name:
            raise NotFound("choose a tenant first", param="tenant")
        with ctx.sessions() as db:
            return tenant_service.tenant_context(session=db, name=tenant_name)
    if tenant_name and tenant_name != session.tenant_name:
        raise NotFound(f"tenant {tenant_name!r} does not exist", param="tenant")
    return tenant_service.authenticate_tenant(ctx=ctx, token=session.key)


SESSION_LIFETIME_S = 8 * 3600.0
"""How long a console sign-in lasts (the key is still checked at every click)."""
MAX_SESSIONS = 10_000
COOKIE = "loraplex_console"
"""The cookie that carries a console-session token (HttpOnly, SameSite=Strict, path = the console's)."""


class ConsoleSessions:
    """The console's sessions, the one owner of them: token -> the :class:`ConsoleSession` that
    opened it, valid ``lifetime_s`` after sign-in (``clock``: seconds). A token is 256 random bits
    (43 URL-safe characters) that the browser holds only as the HttpOnly cookie :data:`COOKIE`; the
    gate (``gate.py``) checks it before Gradio reads a body, the page checks it when it loads (a
    reload stays signed in). At most ``max_sessions`` live at once (the oldest goes). In memory and
    thread-safe: a restart signs everyone out."""

    def __init__(self, ctx: PlatformContext, *, lifetime_s: float = SESSION_LIFETIME_S,
                 max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.lifetime_s = lifetime_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: dict[str, tuple[ConsoleSession, float]] = {}
        self._lock = threading.Lock()

    def open(self, key: str | None) -> str:
        """A new token for ``key`` (:func:`login`). Raises ``Unauthenticated`` for a wrong key."""
        session = login(self.ctx, key)
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._drop_expired()
            if len(self._sessions) >= self.max_sessions:  # drop the oldest
                del self._sessions[min(self._sessions, key=lambda t: self._sessions[t][1])]
            self._sessions[token] = (session, self._clock() + self.lifetime_s)
        return token

    def resume(self, token: str | None) -> ConsoleSession:
        """The live session of ``token``, its key checked again (:func:`check`). Raises
        ``Unauthenticated`` for an unknown, ended or expired token or a revoked key (then ended)."""
        with self._lock:
            self._drop_expired()
            found = self._sessions.get(token) if isinstance(token, str) else None
        if found is None:
            raise Unauthenticated("Sign in to the console first.")
        try:
            return check(self.ctx, found[0])
        except Unauthenticated:
            self.close(token)
            raise

    def close(self, token: str | None) -> None:
        """End ``token``'s session (sign out); unknown tokens are ignored."""
        with self._lock:
            self._sessions.pop(token or "", None)

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired()
            return len(self._sessions)

    def _drop_expired(self) -> None:
        now = self._clock()
        for token in [t for t, (_, expires) in self._sessions.items() if expires <= now]:
            del self._sessions[token]
