"""Binding pure callbacks ``fn(ctx, session, *inputs)`` to Gradio events.

A bound handler shows a service error (``PlatformError``, pydantic
``ValidationError``) as a message in its last output and leaves the other
outputs unchanged (``gr.skip()``), so the page never shows a stack trace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gradio as gr
from pydantic import ValidationError

from loraplex.platform.api.guards import REGISTRY_ERRORS, registry_unavailable
from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import PlatformError
from loraplex.ui.format import error_text

SERVICE_ERRORS = (PlatformError, ValidationError)


def with_error_message(result_count: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or on a service error ``result_count - 1`` skips then the error text
    (an unreachable registry database shows as its 503 message, never the driver's text)."""
    try:
        return fn(*args)
    except (*SERVICE_ERRORS, *REGISTRY_ERRORS) as exc:
        message = error_text(exc if isinstance(exc, SERVICE_ERRORS) else registry_unavailable())
        skips = [gr.skip()] * (result_count - 1)
        return (*skips, message) if skips else message


def on(event: Callable[..., Any], ctx: PlatformContext, fn: Callable[..., Any], inputs: Sequence[gr.Component],
       outputs: Sequence[gr.Component], **kwargs: Any):
    """Wire ``event`` (e.g. ``button.click``) to ``fn(ctx, *input values)``; the last output
    receives error messages. Returns the event's dependency (for ``.then``)."""
    count = len(outputs)

    def handler(*values: Any) -> Any:
        return with_error_message(count, fn, ctx, *values)

    return event(handler, inputs=list(inputs), outputs=list(outputs), api_visibility="private", **kwargs)
