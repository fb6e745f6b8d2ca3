"""Typed platform errors. Services raise them; the API turns each into an HTTP
status and an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
(https://platform.openai.com/docs/guides/error-codes)."""

from __future__ import annotations

from typing import Any


class PlatformError(Exception):
    """Base class: ``status_code`` (HTTP), ``type`` and ``code`` as in the OpenAI error schema,
    ``param`` the offending request field (or None)."""

    status_code: int = 400
    type: str = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def __reduce__(self):
        # Pickled with its param and code (upload checks raise them in a worker process).
        return _restore, (type(self), self.__dict__.copy())

    def to_body(self) -> dict[str, Any]:
        """The JSON error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """Extra response headers."""
        return {}


def _restore(cls: type[PlatformError], state: dict[str, Any]) -> PlatformError:
    error = cls.__new__(cls)
    Exception.__init__(error, state.get("message", ""))
    error.__dict__.update(state)
    return error


class InvalidRequest(PlatformError):
    """400: a request field has a bad value."""

    code = "invalid_value"


class ContextLengthExceeded(InvalidRequest):
    """400: prompt plus max_tokens does not fit in max_model_len."""

    code = "context_length_exceeded"


class ClientDisconnected(PlatformError):
    """499 (nginx's "client closed request"): the client went away before its non-streamed response was ready;
    the request was aborted. Nobody reads the answer; the status keeps the server log free of a traceback."""

    status_code = 499
    code = "client_disconnected"


class Unauthenticated(PlatformError):
    """401: missing, unknown or revoked bearer key."""

    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(PlatformError):
    """404: the resource does not exist (or belongs to another tenant: the body is the same)."""

    status_code = 404
    code = "not_found"


class ModelNotFound(NotFound):
    """404: the ``model`` of a serving request is neither the base model nor one of the tenant's adapters."""

    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.", param="model")


class Conflict(PlatformError):
    """409: the resource already exists."""

    status_code = 409
    code = "already_exists"


class LimitExceeded(PlatformError):
    """403: a tenant quota (e.g. max adapters) is used up."""

    status_code = 403
    type = "permission_error"
    code = "quota_exceeded"


class PayloadTooLarge(PlatformError):
    """413: an upload is over the size limit."""

    status_code = 413
    code = "payload_too_large"


class UnsupportedMediaType(PlatformError):
    """415: an upload has the wrong content type or file format."""

    status_code = 415
    code = "unsupported_media_type"


class RateLimited(PlatformError):
    """429: the tenant's requests- or tokens-per-minute limit is reached; retry after ``retry_after_s``."""

    status_code = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServiceUnavailable(PlatformError):
    """503: no model is loaded, or the engine stopped."""

    status_code = 503
    type = "server_error"
    code = "service_unavailable"


class QueueTimedOut(ServiceUnavailable):
    """503: the request waited longer than its tenant's ``max_queue_time_s`` before its first
    scheduling step (the server is busy); retry after ``retry_after_s``."""

    code = "queue_timeout"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ReplicaFailed(ServiceUnavailable):
    """503: the engine replica serving the request died (``loraplex serve --replicas``); the
    replica is being replaced and new requests go to live replicas, so a retry may succeed."""

    code = "replica_failed"

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}


class ServerShuttingDown(ServiceUnavailable):
    """In-band at the end of a stream (its HTTP status was 200 already; ``type`` server_error): the server is shutting
    down (Ctrl-C / SIGTERM) and the stream did not finish within ``shutdown_stream_grace_s`` of the signal; its engine
    request was aborted. Retry the request."""

    code = "server_shutting_down"

    def __init__(self, grace_s: float) -> None:
        super().__init__(f"the server is shutting down: this stream did not finish within the {grace_s:g} s it was "
                         "given and was ended before its last token; retry the request")


class AdapterBroken(PlatformError):
    """409: the adapter's stored files no longer match what was uploaded (changed or damaged
    on the server); uploading the original again repairs it."""

    status_code = 409
    code = "adapter_broken"

    def __init__(self, name: str) -> None:
        super().__init__(f"adapter {name!r} cannot be served: its stored files are damaged; upload it again to "
                         "repair it", param="model")


class InternalError(PlatformError):
    """500: an unexpected failure. The body says only that (and a reference to find the
    details in the server log); never exception text, paths or database driver messages."""

    status_code = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self, reference: str | None = None) -> None:
        suffix = f" (reference {reference})" if reference else ""
        super().__init__(f"internal server error{suffix}")
