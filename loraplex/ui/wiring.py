"""Binding pure callbacks ``fn(ctx, session, *inputs)`` to Gradio events.

A bound handler shows a service error (``PlatformError``, pydantic
``ValidationError``) as a message in its last output and leaves the other
outputs unchanged (``gr.skip()``), so the page never shows a stack trace. Any other
exception is logged with a reference and shown as "internal error (reference ...)": its
text (database driver messages, server paths) never reaches the page.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import gradio as gr
from pydantic import ValidationError

from loraplex.platform.api.guards import REGISTRY_ERRORS, registry_unavailable
from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import InternalError, PlatformError
from loraplex.ui.format import error_text

SERVICE_ERRORS = (PlatformError, ValidationError)
logger = logging.getLogger(__name__)


def with_error_message(result_count: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or on a service error ``result_count - 1`` skips then the error text
    (an unreachable registry database shows as its 503 message, never the driver's text)."""
    try:
        return fn(*args)
    except (*SERVICE_ERRORS, *REGISTRY_ERRORS) as exc:
        text = error_text(exc if isinstance(exc, SERVICE_ERRORS) else registry_unavailable())
    except Exception:  # noqa: BLE001 - unexpected: details to the log, a reference to the page
        reference = uuid.uuid4().hex[:12]
        logger.exception("console callback %s failed (reference %s)", getattr(fn, "__name__", fn), reference)
        text = error_text(InternalError(reference))
    skips = [gr.skip()] * (result_count - 1)
    return (*skips, text) if skips else text


def on(event: Callable[..., Any], ctx: PlatformContext, fn: Callable[..., Any], inputs: Sequence[gr.Component],
       outputs: Sequence[gr.Component], **kwargs: Any):
    """Wire ``event`` (e.g. ``button.click``) to ``fn(ctx, *input values)``; the last output
    receives error messages. Returns the event's dependency (for ``.then``)."""
    count = len(outputs)

    def handler(*values: Any) -> Any:
        return with_error_message(count, fn, ctx, *values)

    return event(handler, inputs=list(inputs), outputs=list(outputs), api_visibility="private", **kwargs)
