"""``GET /v1/models`` (the base model and the caller's ready adapters) and ``GET /v1/models/{id}``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.concurrency import run_in_threadpool

from loraplex.platform.api.deps import CtxDep, CurrentTenant
from loraplex.platform.openai_schemas import ErrorResponse, ModelCard, ModelList
from loraplex.platform.services import models as model_service

router = APIRouter(prefix="/v1", tags=["serving"])


@router.get("/models", response_model=ModelList)
async def list_models(ctx: CtxDep, tenant: CurrentTenant) -> ModelList:
    return await run_in_threadpool(model_service.list_models, ctx=ctx, tenant=tenant)


@router.get("/models/{model_id:path}", response_model=ModelCard,
            responses={404: {"model": ErrorResponse, "description": "Not a model this key can use."}})
async def retrieve_model(model_id: str, ctx: CtxDep, tenant: CurrentTenant) -> ModelCard:
    return await run_in_threadpool(model_service.get_model, ctx=ctx, tenant=tenant, model_id=model_id)
