"""Adapter evaluations: tenants run and read their own under ``/v1/evaluations``; the
admin reads every tenant's under ``/admin/evaluations``.

``POST /v1/evaluations?adapter=NAME[&adapter=NAME...][&name=SET]`` takes the JSONL
evaluation set as the raw request body (any ``Content-Type``; the schema declares
``text/plain``) and answers when the run is over with the stored rows.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool

from loraplex.platform.api.deps import AdminDep, CtxDep, CurrentTenant, SessionDep
from loraplex.platform.errors import PayloadTooLarge
from loraplex.platform.schemas import EvaluationPublic
from loraplex.platform.services import evaluation as evaluation_service
from loraplex.platform.services import tenants as tenant_service

router = APIRouter(tags=["evaluations"])

EVAL_OPENAPI = {"requestBody": {"required": True, "content": {
    "text/plain": {"schema": {"type": "string", "description": "JSONL, one JSON item per line: "
                                     "{prompt, choices, answer} or {prompt, reference}."}}}}}


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it passes ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"the evaluation set is larger than eval_max_file_bytes={max_bytes} bytes",
                              param="file")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"the evaluation set is larger than eval_max_file_bytes={max_bytes} bytes",
                                  param="file")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("/v1/evaluations", response_model=list[EvaluationPublic], status_code=201, openapi_extra=EVAL_OPENAPI)
async def run_own_evaluation(request: Request, ctx: CtxDep, tenant: CurrentTenant,
                             adapter: Annotated[list[str], Query()], name: str = "eval.jsonl",
                             ) -> list[EvaluationPublic]:
    data = await _read_body(request, ctx.settings.eval_max_file_bytes)
    eval_set = evaluation_service.parse_eval_set(data, name=name, settings=ctx.settings)
    report = await evaluation_service.run_evaluation(ctx=ctx, tenant=tenant, adapter_names=adapter,
                                                     eval_set=eval_set)

    def stored() -> list[EvaluationPublic]:
        with ctx.sessions() as session:
            rows = evaluation_service.list_evaluations(session=session, tenant_id=tenant.tenant_id)
        return [r for r in rows if r.run_id == report.run_id]

    return await run_in_threadpool(stored)


@router.get("/v1/evaluations", response_model=list[EvaluationPublic])
def list_own_evaluations(session: SessionDep, tenant: CurrentTenant,
                         adapter: str | None = None) -> list[EvaluationPublic]:
    return evaluation_service.list_evaluations(session=session, tenant_id=tenant.tenant_id, adapter_name=adapter)


@router.get("/admin/evaluations", response_model=list[EvaluationPublic], tags=["admin"])
def list_all_evaluations(session: SessionDep, _: AdminDep, tenant: str | None = None,
                         adapter: str | None = None) -> list[EvaluationPublic]:
    tenant_id = tenant_service.tenant_context(session=session, name=tenant).tenant_id if tenant else None
    return evaluation_service.list_evaluations(session=session, tenant_id=tenant_id, adapter_name=adapter)
