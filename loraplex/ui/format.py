"""Turning service results and errors into what the console shows (text only, no Gradio)."""

from __future__ import annotations

import datetime as dt

from pydantic import ValidationError

from loraplex.platform.errors import PlatformError

ERROR_MARK = "**Error:**"
OK_MARK = "✓"


def error_text(exc: BaseException, fields: dict[str, str] | None = None) -> str:
    """One Markdown line for a service error: its message and the offending field.

    ``PlatformError`` -> its message (and ``param``, or the form's own words for it:
    ``fields`` maps an API field name to a phrase such as "the chosen files", shown as
    "(check the chosen files)"); ``pydantic.ValidationError`` -> each
    failing field with its value. Anything else is not expected here and is re-raised by
    the caller (Gradio then shows the exception's message, never a stack trace).
    """
    if isinstance(exc, PlatformError):
        if fields and exc.param in fields:
            field = f" (check {fields[exc.param]})"
        else:
            field = f" (field `{exc.param}`)" if exc.param else ""
        return f"{ERROR_MARK} {exc.message}{field}"
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "value"
            parts.append(f"`{where}`={err.get('input')!r}: {err['msg']}")
        return f"{ERROR_MARK} " + "; ".join(parts)
    raise TypeError(f"not a service error: {type(exc).__name__}")


def ok_text(message: str) -> str:
    return f"{OK_MARK} {message}"


def format_bytes(size_bytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_time(when: dt.datetime | None) -> str:
    """UTC ``YYYY-MM-DD HH:MM:SS`` (empty for None)."""
    if when is None:
        return ""
    if when.tzinfo is not None:
        when = when.astimezone(dt.UTC)
    return when.strftime("%Y-%m-%d %H:%M:%S")


def format_number(value: float) -> str:
    """``1000000.0`` -> ``"1000000"``, ``2.5`` -> ``"2.5"`` (no exponent)."""
    return str(int(value)) if float(value).is_integer() else str(value)


def format_limit(value: float | None) -> str:
    """A per-tenant limit: ``None`` is unlimited."""
    return "unlimited" if value is None else format_number(value)
