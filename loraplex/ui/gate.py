"""Nothing under the console's path accepts data before sign-in.

Gradio's own endpoints (``/ui/gradio_api/upload`` stores files; ``run``, ``call``, ``api``,
``process_recording``, ...) know nothing of the console's sign-in, which happens inside a
Gradio event. So signing in also opens a *console session*: the page's sign-in button first
posts the typed key to ``POST /ui/session`` (``Authorization: Bearer <key>``), which checks it
like the API does and answers with an HttpOnly, SameSite=Strict cookie scoped to ``/ui``.

:class:`ConsoleGate` (ASGI, in front of the mounted console) then refuses, with 401 and
before reading one byte of the body, every request with a body under ``/ui`` that carries
no valid console-session cookie, except the few the sign-in page itself needs
(:data:`OPEN_BEFORE_SIGN_IN`: the event queue, whose callbacks check the session themselves).
Bodies are capped: uploads at the server's upload limit, everything else at the JSON limit
(413). The key behind a cookie is checked again on every use, so a revoked key or deleted
tenant loses its console session at once; sessions expire after :data:`SESSION_LIFETIME_S`.
Files Gradio stores are deleted after ``settings.console_file_lifetime_s``.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.platform.api.guards import (
    REGISTRY_ERRORS,
    bearer,
    body_cap,
    counting_receive,
    registry_unavailable,
    send_error,
)
from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import PlatformError, Unauthenticated
from loraplex.ui.session import ConsoleSession, check, login

COOKIE = "loraplex_console"
SESSION_LIFETIME_S = 8 * 3600
MAX_SESSIONS = 10_000
OPEN_BEFORE_SIGN_IN = ("/gradio_api/queue/join", "/gradio_api/cancel", "/gradio_api/reset")
"""Gradio endpoints (below the console path) the sign-in page posts to before a session exists."""
UPLOAD_PATHS = ("/gradio_api/upload", "/gradio_api/process_recording")
_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


class ConsoleSessions:
    """Console-session tokens -> the :class:`ConsoleSession` that opened them (in memory;
    thread-safe). A token is 256 random bits; at most ``max_sessions`` live at once."""

    def __init__(self, ctx: PlatformContext, *, lifetime_s: float = SESSION_LIFETIME_S,
                 max_sessions: int = MAX_SESSIONS, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.lifetime_s = lifetime_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: dict[str, tuple[ConsoleSession, float]] = {}
        self._lock = threading.Lock()

    def open(self, key: str | None) -> str:
        """A new token for ``key``. Raises ``Unauthenticated`` for a wrong key."""
        session = login(self.ctx, key)
        token = secrets.token_urlsafe(32)
        with self._lock:
            now = self._clock()
            for old in [t for t, (_, expires) in self._sessions.items() if expires <= now]:
                del self._sessions[old]
            if len(self._sessions) >= self.max_sessions:  # drop the oldest
                del self._sessions[min(self._sessions, key=lambda t: self._sessions[t][1])]
            self._sessions[token] = (session, now + self.lifetime_s)
        return token

    def close(self, token: str | None) -> None:
        with self._lock:
            self._sessions.pop(token or "", None)

    def check(self, token: str | None) -> ConsoleSession:
        """The live session of ``token``, its key checked again. Raises ``Unauthenticated``."""
        with self._lock:
            found = self._sessions.get(token or "")
            if found is not None and found[1] <= self._clock():
                del self._sessions[token]
                found = None
        if found is None:
            raise Unauthenticated("Sign in to the console first.")
        try:
            return check(self.ctx, found[0])
        except Unauthenticated:
            self.close(token)
            raise


def session_router(sessions: ConsoleSessions, path: str) -> APIRouter:
    """``POST {path}/session`` (bearer key -> cookie, 204) and ``DELETE {path}/session`` (204)."""
    router = APIRouter(include_in_schema=False)

    @router.post(f"{path}/session", status_code=204)
    async def open_session(request: Request) -> Response:
        token = await run_in_threadpool(sessions.open, bearer(request.scope))
        response = Response(status_code=204)
        response.set_cookie(COOKIE, token, max_age=int(sessions.lifetime_s), path=path, httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")
        return response

    @router.delete(f"{path}/session", status_code=204)
    async def close_session(request: Request) -> Response:
        sessions.close(request.cookies.get(COOKIE))
        response = Response(status_code=204)
        response.delete_cookie(COOKIE, path=path)
        return response

    return router


def _cookie(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                cookie_name, _, cookie_value = part.strip().partition("=")
                if cookie_name == COOKIE:
                    return cookie_value
    return None


class ConsoleGate:
    """See the module docstring."""

    def __init__(self, app: ASGIApp, *, sessions: ConsoleSessions, path: str, max_json_body_bytes: int,
                 max_upload_body_bytes: int) -> None:
        self.app = app
        self.sessions = sessions
        self.path = path
        self.max_json_body_bytes = max_json_body_bytes
        self.max_upload_body_bytes = max_upload_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if (scope["type"] != "http" or scope.get("method") not in _BODY_METHODS
                or not path.startswith(self.path + "/") or path == f"{self.path}/session"):
            await self.app(scope, receive, send)
            return
        inner = path[len(self.path):].rstrip("/")
        try:
            if inner not in OPEN_BEFORE_SIGN_IN:
                await run_in_threadpool(self.sessions.check, _cookie(scope))
        except PlatformError as exc:
            await send_error(exc, scope, receive, send)
            return
        except REGISTRY_ERRORS:
            await send_error(registry_unavailable(), scope, receive, send)
            return
        limit, what, refusal = body_cap(scope, is_upload=inner in UPLOAD_PATHS,
                                        max_upload_body_bytes=self.max_upload_body_bytes,
                                        max_json_body_bytes=self.max_json_body_bytes)
        if refusal is not None:
            await send_error(refusal, scope, receive, send)
            return
        await self.app(scope, counting_receive(receive, limit, what), send)


def install_gate(app: FastAPI, ctx: PlatformContext, *, path: str) -> ConsoleSessions:
    """Add the session routes and :class:`ConsoleGate` for the console mounted at ``path``
    (call before mounting it, so ``{path}/session`` is matched first)."""
    from loraplex.platform.api.uploads import MULTIPART_OVERHEAD_BYTES
    from loraplex.platform.services.adapters import MB

    sessions = ConsoleSessions(ctx)
    app.include_router(session_router(sessions, path))
    app.add_middleware(ConsoleGate, sessions=sessions, path=path,
                       max_json_body_bytes=int(ctx.settings.max_json_body_mb * MB),
                       max_upload_body_bytes=int(ctx.settings.max_upload_mb * MB) + MULTIPART_OVERHEAD_BYTES)
    app.state.console_sessions = sessions
    return sessions
