"""Adapter management: tenants under ``/v1/adapters`` (their own only), admins under
``/admin/tenants/{tenant}/adapters``. Both use the same upload rules."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from loraplex.platform.api.deps import AdminDep, CtxDep, CurrentTenant, SessionDep
from loraplex.platform.api.uploads import UPLOAD_OPENAPI, read_upload
from loraplex.platform.context import PlatformContext
from loraplex.platform.schemas import AdapterPublic, TenantContext
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import tenants as tenant_service
from loraplex.platform.services.adapters import MB

tenant_router = APIRouter(prefix="/v1/adapters", tags=["adapters"])
admin_router = APIRouter(prefix="/admin/tenants/{tenant}/adapters", tags=["admin"])


async def _upload(request: Request, session, ctx: PlatformContext, tenant: TenantContext) -> AdapterPublic:
    max_bytes = int(min(tenant.max_upload_mb, ctx.settings.max_upload_mb) * MB)
    name, parts, form = await read_upload(request, max_bytes)
    try:
        return await run_in_threadpool(adapter_service.upload_adapter, session=session, ctx=ctx, tenant=tenant,
                                       name=name, parts=parts)
    finally:
        await form.close()


# -- tenant API ------------------------------------------------------------------------------------
@tenant_router.post("", response_model=AdapterPublic, status_code=201, openapi_extra=UPLOAD_OPENAPI)
async def upload_own_adapter(request: Request, session: SessionDep, ctx: CtxDep,
                             tenant: CurrentTenant) -> AdapterPublic:
    return await _upload(request, session, ctx, tenant)


@tenant_router.get("", response_model=list[AdapterPublic])
def list_own_adapters(session: SessionDep, tenant: CurrentTenant) -> list[AdapterPublic]:
    return adapter_service.list_adapters(session=session, tenant_id=tenant.tenant_id)


@tenant_router.get("/{name}", response_model=AdapterPublic)
def get_own_adapter(name: str, session: SessionDep, tenant: CurrentTenant) -> AdapterPublic:
    return adapter_service.get_adapter(session=session, tenant_id=tenant.tenant_id, name=name)


@tenant_router.delete("/{name}", status_code=204)
def delete_own_adapter(name: str, session: SessionDep, ctx: CtxDep, tenant: CurrentTenant) -> Response:
    adapter_service.delete_adapter(session=session, ctx=ctx, tenant_id=tenant.tenant_id, name=name)
    return Response(status_code=204)


# -- admin API -------------------------------------------------------------------------------------
@admin_router.post("", response_model=AdapterPublic, status_code=201, openapi_extra=UPLOAD_OPENAPI)
async def upload_tenant_adapter(tenant: str, request: Request, session: SessionDep, ctx: CtxDep,
                                _: AdminDep) -> AdapterPublic:
    owner = await run_in_threadpool(tenant_service.tenant_context, session=session, name=tenant)
    return await _upload(request, session, ctx, owner)


@admin_router.get("", response_model=list[AdapterPublic])
def list_tenant_adapters(tenant: str, session: SessionDep, _: AdminDep) -> list[AdapterPublic]:
    owner = tenant_service.tenant_context(session=session, name=tenant)
    return adapter_service.list_adapters(session=session, tenant_id=owner.tenant_id)


@admin_router.get("/{name}", response_model=AdapterPublic)
def get_tenant_adapter(tenant: str, name: str, session: SessionDep, _: AdminDep) -> AdapterPublic:
    owner = tenant_service.tenant_context(session=session, name=tenant)
    return adapter_service.get_adapter(session=session, tenant_id=owner.tenant_id, name=name)


@admin_router.delete("/{name}", status_code=204)
def delete_tenant_adapter(tenant: str, name: str, session: SessionDep, ctx: CtxDep, _: AdminDep) -> Response:
    owner = tenant_service.tenant_context(session=session, name=tenant)
    adapter_service.delete_adapter(session=session, ctx=ctx, tenant_id=owner.tenant_id, name=name)
    return Response(status_code=204)
