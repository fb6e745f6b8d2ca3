"""``POST /v1/completions`` and ``POST /v1/chat/completions`` (OpenAI-compatible)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.platform.api.deps import CtxDep, CurrentTenant
from loraplex.platform.errors import RateLimited
from loraplex.platform.openai_schemas import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest
from loraplex.platform.services import serving

router = APIRouter(prefix="/v1", tags=["serving"])

_STREAM_DOC = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                     "description": "JSON, or server-sent events when `stream` is true."}}


@router.post("/completions", response_model=Completion, responses=_STREAM_DOC)
async def create_completion(body: CompletionRequest, request: Request, ctx: CtxDep, tenant: CurrentTenant):
    prep = await run_in_threadpool(serving.prepare_completion, ctx=ctx, tenant=tenant, body=body)
    return await _respond(ctx, prep, request)


@router.post("/chat/completions", response_model=ChatCompletion, responses=_STREAM_DOC)
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
        return StreamingResponse(serving.stream_sse(ctx, prep, streams), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    body = await serving.run_to_completion(ctx, prep, streams, request.is_disconnected)
    return JSONResponse(body)
