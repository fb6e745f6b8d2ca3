"""``GET /v1/models``: the base model and the caller's ready adapters."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from loraplex.platform.api.deps import CtxDep, CurrentTenant
from loraplex.platform.openai_schemas import ModelList
from loraplex.platform.services import models as model_service

router = APIRouter(prefix="/v1", tags=["serving"])


@router.get("/models", response_model=ModelList)
async def list_models(ctx: CtxDep, tenant: CurrentTenant) -> ModelList:
    return await run_in_threadpool(model_service.list_models, ctx=ctx, tenant=tenant)
