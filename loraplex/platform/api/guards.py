"""ASGI middlewares that run before any route reads a request body.

- :class:`RequestGuard`: for a request with a body (POST/PUT/PATCH) to ``/v1/*`` or
  ``/admin/*``, authenticate from the headers first (``/admin/*``: the admin key;
  ``/v1/*``: a tenant key, handed to the route through ``request.state.tenant``), so an
  unauthenticated body is refused (401) without one byte of it being read; then cap the
  body: adapter uploads (``POST .../adapters``) at the upload limit, streamed and counted;
  every other body (JSON) at ``max_json_body_bytes``, read here first (413 before the app
  sees it). A declared ``Content-Length`` over the cap is refused at once. (The console
  under ``/ui`` has its own gate: ``loraplex.ui.gate``.)
- :class:`SecurityHeaders`: every response says ``X-Frame-Options: DENY``,
  ``Content-Security-Policy: frame-ancestors 'none'`` and ``X-Content-Type-Options: nosniff``
  (the console must not be framed by another site: clickjacking).

All refusals use the OpenAI error body (``{"error": {"message", "type", "param", "code"}}``).
"""

from __future__ import annotations

import logging

from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sa_exc
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.platform.context import PlatformContext
from loraplex.platform.core.security import parse_bearer
from loraplex.platform.errors import PayloadTooLarge, PlatformError, ServiceUnavailable
from loraplex.platform.services import tenants as tenant_service

logger = logging.getLogger(__name__)

REGISTRY_ERRORS = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError, sa_exc.DisconnectionError)
"""SQLAlchemy errors that mean "the database cannot be reached" (not bad input)."""

SECURITY_HEADERS = [(b"x-frame-options", b"DENY"), (b"content-security-policy", b"frame-ancestors 'none'"),
                    (b"x-content-type-options", b"nosniff")]
_BODY_METHODS = {"POST", "PUT", "PATCH"}


def registry_unavailable() -> ServiceUnavailable:
    """The 503 a request gets when it needs the database and the database is unreachable
    (no driver text, host or port: those go to the log)."""
    return ServiceUnavailable("The adapter registry is unavailable right now; retry shortly.",
                              code="registry_unavailable")


async def send_error(exc: PlatformError, scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse(exc.to_body(), status_code=exc.status_code, headers=exc.headers())(scope, receive, send)


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def bearer(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return parse_bearer(value.decode("latin-1"))
    return None


def body_cap(scope: Scope, *, is_upload: bool, max_upload_body_bytes: int, max_json_body_bytes: int
             ) -> tuple[int, str, PayloadTooLarge | None]:
    """``(limit_bytes, what, refusal)`` for a request body: the cap of an upload or of a JSON
    body, its name for messages, and a 413 when ``Content-Length`` already declares more."""
    limit = max_upload_body_bytes if is_upload else max_json_body_bytes
    what = "the upload" if is_upload else "the request body"
    declared = declared_length(scope)
    refusal = None
    if declared is not None and declared > limit:
        refusal = PayloadTooLarge(f"{what} is {declared} bytes; the limit is {limit} bytes")
    return limit, what, refusal


def counting_receive(receive: Receive, max_bytes: int, what: str) -> Receive:
    """``receive`` that raises ``PayloadTooLarge`` once more than ``max_bytes`` body bytes came."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise PayloadTooLarge(f"{what} is more than {max_bytes} bytes", param=None)
        return message

    return limited


class RequestGuard:
    """Authenticate from headers, then cap the body (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, ctx: PlatformContext, max_json_body_bytes: int,
                 max_upload_body_bytes: int) -> None:
        self.app = app
        self.ctx = ctx
        self.max_json_body_bytes = max_json_body_bytes
        self.max_upload_body_bytes = max_upload_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS or not path.startswith(
                ("/v1/", "/admin/")):
            await self.app(scope, receive, send)
            return
        try:
            await self._authenticate(scope, path)
        except PlatformError as exc:
            await send_error(exc, scope, receive, send)
            return
        except REGISTRY_ERRORS:
            logger.warning("authentication needs the registry, which is unreachable", exc_info=True)
            await send_error(registry_unavailable(), scope, receive, send)
            return
        is_upload = path.rstrip("/").endswith("/adapters")
        limit, what, refusal = body_cap(scope, is_upload=is_upload, max_upload_body_bytes=self.max_upload_body_bytes,
                                        max_json_body_bytes=self.max_json_body_bytes)
        if refusal is not None:
            await send_error(refusal, scope, receive, send)
            return
        if is_upload:
            await self.app(scope, counting_receive(receive, limit, what), send)
            return
        body = await _read_body(receive, limit)
        if body is None:
            await send_error(PayloadTooLarge(f"{what} is more than {limit} bytes"), scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _authenticate(self, scope: Scope, path: str) -> None:
        token = bearer(scope)
        if path.startswith("/admin/"):
            tenant_service.authenticate_admin(ctx=self.ctx, token=token)
            return
        tenant = await run_in_threadpool(tenant_service.authenticate_tenant, ctx=self.ctx, token=token)
        scope.setdefault("state", {})["tenant"] = tenant


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None as soon as it is longer than ``limit`` (the rest is not read)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as Starlette expects

    return replay


class SecurityHeaders:
    """Add :data:`SECURITY_HEADERS` to every HTTP response (unless the app set them)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": with_security_headers(list(message.get("headers", [])))}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def with_security_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """``headers`` plus the missing :data:`SECURITY_HEADERS`; an existing CSP without
    ``frame-ancestors`` gets ``frame-ancestors 'none'`` appended."""
    out = []
    present = set()
    for name, value in headers:
        name = name.lower()
        present.add(name)
        if name == b"content-security-policy" and b"frame-ancestors" not in value:
            value = value.rstrip(b"; ") + b"; frame-ancestors 'none'"
        out.append((name, value))
    out.extend((name, value) for name, value in SECURITY_HEADERS if name not in present)
    return out
