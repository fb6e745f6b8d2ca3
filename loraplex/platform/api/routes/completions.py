"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI-compatible).

Responses are the typed models of :mod:`loraplex.platform.openai_schemas` (``response_model``
is enforced); with ``stream: true`` the typed chunks are sent as server-sent events by
sse-starlette's ``EventSourceResponse`` (``data: {chunk}`` each, then ``data: [DONE]``).

At server shutdown (Ctrl-C / SIGTERM: uvicorn stops accepting and waits for the requests in flight) a stream goes
on for ``shutdown_stream_grace_s`` from the moment sse-starlette reports the shutdown (``shutdown_event``; it polls
every 0.5 s); then its engine requests are failed with ``ServerShuttingDown`` (aborted), so the stream ends with that
error event, whether it was sending or still waiting for its first token. sse-starlette cancels any stream still
open :data:`FORCE_CANCEL_MARGIN_S` after that (its connection is then cut).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

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
)
from loraplex.platform.services import serving

router = APIRouter(prefix="/v1", tags=["serving"])
FORCE_CANCEL_MARGIN_S = 5.0
"""Seconds past ``shutdown_stream_grace_s`` after which sse-starlette cancels a stream that has not ended (its engine
requests were failed at the grace's end; this is the bound if that does not end it)."""


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
        return EventSourceResponse(_events(serving.stream_chunks(ctx, prep, streams), shutdown, grace_s, streams),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                   shutdown_event=shutdown, shutdown_grace_period=grace_s + FORCE_CANCEL_MARGIN_S)
    return await serving.run_to_completion(ctx, prep, streams, request.is_disconnected)


async def _events(chunks: AsyncIterator[serving.StreamEvent], shutdown: anyio.Event, grace_s: float,
                  streams: Sequence) -> AsyncIterator[ServerSentEvent]:
    """The stream's chunks as events, then ``[DONE]``. ``grace_s`` after ``shutdown`` is set, ``streams`` (the
    engine request streams under ``chunks``) are failed with ``ServerShuttingDown``: ``chunks`` then yields its
    error event (the OpenAI error format) and ends."""
    async def expire() -> None:
        await shutdown.wait()
        await anyio.sleep(grace_s)
        for stream in streams:
            stream.fail(ServerShuttingDown(grace_s))

    expiry = asyncio.ensure_future(expire())
    try:
        async for chunk in chunks:
            yield ServerSentEvent(chunk.model_dump_json())
        yield ServerSentEvent("[DONE]")
    finally:
        expiry.cancel()
        await chunks.aclose()
