"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI-compatible).

Responses are the typed models of :mod:`loraplex.platform.openai_schemas` (``response_model``
is enforced); with ``stream: true`` the typed chunks are sent as server-sent events by
sse-starlette's ``EventSourceResponse`` (``data: {chunk}`` each, then ``data: [DONE]``).

At server shutdown (Ctrl-C / SIGTERM: uvicorn stops accepting and waits for the requests in flight) a stream goes
on for ``shutdown_stream_grace_s``; past it, at its next chunk, it ends with a ``server_shutting_down`` error
event (and its engine request is aborted) instead of the connection being cut. sse-starlette signals the
shutdown (``shutdown_event``) and force-cancels a stream that has sent nothing for
:data:`FORCE_CANCEL_MARGIN_S` more seconds.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse, ServerSentEvent

from loraplex.platform.api.deps import CtxDep, CurrentTenant
from loraplex.platform.errors import RateLimited, ServerShuttingDown
from loraplex.platform.openai_schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    ErrorResponse,
)
from loraplex.platform.services import serving

router = APIRouter(prefix="/v1", tags=["serving"])
FORCE_CANCEL_MARGIN_S = 5.0
"""Seconds past ``shutdown_stream_grace_s`` after which sse-starlette cancels a stream that has not ended itself
(one that received no chunk to end at: its connection is then cut)."""


def _stream_doc(chunk: type) -> dict:
    return {200: {"content": {"text/event-stream": {"schema": {
        "type": "string", "description": f"`data: <{chunk.__name__}>` events, then `data: [DONE]`."}}},
        "description": "JSON, or server-sent events when `stream` is true."}}


@router.post("/completions", response_model=Completion, responses=_stream_doc(CompletionChunk))
async def create_completion(body: CompletionRequest, request: Request, ctx: CtxDep, tenant: CurrentTenant):
    prep = await run_in_threadpool(serving.prepare_completion, ctx=ctx, tenant=tenant, body=body)
    return await _respond(ctx, prep, request)


@router.post("/chat/completions", response_model=ChatCompletion, responses=_stream_doc(ChatCompletionChunk))
async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: CtxDep,
                                 tenant: CurrentTenant):
    prep = await run_in_threadpool(serving.prepare_chat, ctx=ctx, tenant=tenant, body=body)
    return await _respond(ctx, prep, request)


async def _respond(ctx, prep: serving.PreparedRequest, request: Request):
    try:
        streams = await serving.start(ctx, prep)
    except RateLimited:
        ctx.metrics.rate_limited.inc()
        raise
    if prep.stream:
        shutdown = anyio.Event()
        grace_s = ctx.settings.shutdown_stream_grace_s
        return EventSourceResponse(_events(serving.stream_chunks(ctx, prep, streams), shutdown, grace_s),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                   shutdown_event=shutdown, shutdown_grace_period=grace_s + FORCE_CANCEL_MARGIN_S)
    return await serving.run_to_completion(ctx, prep, streams, request.is_disconnected)


async def _events(chunks: AsyncIterator[serving.StreamEvent], shutdown: anyio.Event, grace_s: float,
                  clock: Callable[[], float] = time.monotonic) -> AsyncIterator[ServerSentEvent]:
    """The stream's chunks as events, then ``[DONE]``. Once ``shutdown`` is set the grace starts at the stream's
    next chunk (chunks come every engine step); a chunk arriving ``grace_s`` or more after that is replaced by a
    ``server_shutting_down`` error event, then ``[DONE]``, and the chunks are closed (the engine request aborted)."""
    deadline = None
    try:
        async for chunk in chunks:
            if shutdown.is_set():
                if deadline is None:
                    deadline = clock() + grace_s
                if clock() >= deadline:
                    yield ServerSentEvent(ErrorResponse.model_validate(ServerShuttingDown(grace_s).to_body())
                                          .model_dump_json())
                    break
            yield ServerSentEvent(chunk.model_dump_json())
        yield ServerSentEvent("[DONE]")
    finally:
        await chunks.aclose()
