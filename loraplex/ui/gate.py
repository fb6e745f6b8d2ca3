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
tenant loses its console session at once. The sessions are ``session.ConsoleSessions`` (one
store, shared with the page, which resumes a session from the same cookie after a reload).
Files Gradio stores are deleted after ``settings.console_file_lifetime_s``.
"""

from __future__ import annotations

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
from loraplex.platform.errors import PlatformError
from loraplex.ui.session import COOKIE, ConsoleSessions

OPEN_BEFORE_SIGN_IN = ("/gradio_api/queue/join", "/gradio_api/cancel", "/gradio_api/reset")
"""Gradio endpoints (below the console path) the sign-in page posts to before a session exists."""
UPLOAD_PATHS = ("/gradio_api/upload", "/gradio_api/process_recording")
_BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


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
                await run_in_threadpool(self.sessions.resume, _cookie(scope))
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


def install_gate(app: FastAPI, ctx: PlatformContext, *, path: str,
                 sessions: ConsoleSessions | None = None) -> ConsoleSessions:
    """Add the session routes and :class:`ConsoleGate` for the console mounted at ``path``
    (call before mounting it, so ``{path}/session`` is matched first). Returns the sessions
    (``sessions``, default a new :class:`ConsoleSessions`), which the console's page shares."""
    from loraplex.platform.api.uploads import MULTIPART_OVERHEAD_BYTES
    from loraplex.platform.services.adapters import MB

    sessions = ConsoleSessions(ctx) if sessions is None else sessions
    app.include_router(session_router(sessions, path))
    app.add_middleware(ConsoleGate, sessions=sessions, path=path,
                       max_json_body_bytes=int(ctx.settings.max_json_body_mb * MB),
                       max_upload_body_bytes=int(ctx.settings.max_upload_mb * MB) + MULTIPART_OVERHEAD_BYTES)
    app.state.console_sessions = sessions
    return sessions
