"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI-compatible).

Responses are the typed models of :mod:`loraplex.platform.openai_schemas` (``response_model``
is enforced); with ``stream: true`` the typed chunks are sent as server-sent events by
sse-starlette's ``EventSourceResponse`` (``data: {chunk}`` each, then ``data: [DONE]``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from sse_starlette import EventSourceResponse, ServerSentEvent

from loraplex.platform.api.deps import CtxDep, CurrentTenant
from loraplex.platform.errors import RateLimited
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
        return EventSourceResponse(_events(serving.stream_chunks(ctx, prep, streams)),
                                   headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await serving.run_to_completion(ctx, prep, streams, request.is_disconnected)


async def _events(chunks: AsyncIterator[serving.StreamEvent]) -> AsyncIterator[ServerSentEvent]:
    try:
        async for chunk in chunks:
            yield ServerSentEvent(chunk.model_dump_json())
        yield ServerSentEvent("[DONE]")
    finally:
        await chunks.aclose()
