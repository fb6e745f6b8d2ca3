"""Exception handlers: every error leaves as ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.platform.api.guards import REGISTRY_ERRORS, registry_unavailable
from loraplex.platform.errors import PlatformError

logger = logging.getLogger(__name__)

_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
               429: "rate_limit_error"}


def error_body(message: str, type_: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


async def _platform_error(_request: Request, exc: PlatformError) -> JSONResponse:
    return JSONResponse(exc.to_body(), status_code=exc.status_code, headers=exc.headers())


def _field_path(loc) -> list[str]:
    """A pydantic error location as field names: request parts and pydantic's union labels
    (``str``, ``list[...]``, ``function-after[...]``) are not fields."""
    return [str(p) for p in loc if p not in ("body", "query", "path", "header")
            and not (isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p))]


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":  # loc holds a character offset, not a field
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        offset = first.get("loc", ("body", "?"))[-1]
        return JSONResponse(error_body(f"the request body is not valid JSON ({reason} at character {offset})",
                                       "invalid_request_error", code="invalid_json"), status_code=400)
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), (bytes, str)):
        # FastAPI hands a body whose Content-Type is not JSON over unparsed
        return JSONResponse(error_body("the request body must be a JSON object sent with Content-Type: "
                                       "application/json", "invalid_request_error", code="invalid_json"),
                            status_code=400)
    # a wrong value beats an unknown field; the str branch of a content union failing is neither
    relevant = [e for e in errors if not (e.get("loc") and e["loc"][-1] == "str" and e.get("type") == "string_type")]
    wrong = [e for e in relevant if e.get("type") != "extra_forbidden"]
    first = (wrong or relevant or errors or [first])[0]
    if first.get("type") == "extra_forbidden":  # OpenAI's own answer to an unknown request field
        field = (first.get("ctx") or {}).get("field")
        name = ".".join(_field_path(first.get("loc", ())) + ([str(field)] if field else []))
        return JSONResponse(error_body(f"Unrecognized request argument supplied: {name}", "invalid_request_error",
                                       param=name, code="unrecognized_argument"), status_code=400)
    param = ".".join(_field_path(first.get("loc", ()))) or None
    value = first.get("input")
    shown = f" (got {value!r})" if value is not None and not isinstance(value, (dict, list)) else ""
    message = f"{param or 'request'}: {first.get('msg', 'invalid value')}{shown}"
    return JSONResponse(error_body(message, "invalid_request_error", param=param, code="invalid_value"),
                        status_code=400)


# FastAPI's own 400 when reading the JSON body fails past the decoder (e.g. nesting beyond Python's recursion limit)
_BODY_PARSE_DETAIL = "There was an error parsing the body"


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
    if exc.status_code == 400 and exc.detail == _BODY_PARSE_DETAIL:
        return JSONResponse(error_body("the request body is not valid JSON (it could not be parsed)", type_,
                                       code="invalid_json"), status_code=400)
    return JSONResponse(error_body(str(exc.detail), type_, code=None), status_code=exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _registry_error(_request: Request, exc: Exception) -> JSONResponse:
    logger.warning("request failed: the registry database is unreachable (%s)", type(exc).__name__, exc_info=True)
    err = registry_unavailable()
    return JSONResponse(err.to_body(), status_code=err.status_code)


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return JSONResponse(error_body("internal server error", "server_error", code="internal_error"),
                        status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(PlatformError, _platform_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for error in REGISTRY_ERRORS:
        app.add_exception_handler(error, _registry_error)
    app.add_exception_handler(Exception, _unexpected)
