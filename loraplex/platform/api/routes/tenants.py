"""Admin: tenants and their API keys."""

from __future__ import annotations

from fastapi import APIRouter, Response

from loraplex.platform.api.deps import AdminDep, CtxDep, SessionDep
from loraplex.platform.schemas import ApiKeyCreated, ApiKeyPublic, TenantCreate, TenantPublic, TenantUpdate
from loraplex.platform.services import tenants as tenant_service

router = APIRouter(prefix="/admin/tenants", tags=["admin"])


@router.post("", response_model=TenantPublic, status_code=201)
def create_tenant(body: TenantCreate, session: SessionDep, ctx: CtxDep, _: AdminDep) -> TenantPublic:
    return tenant_service.create_tenant(session=session, ctx=ctx, spec=body)


@router.get("", response_model=list[TenantPublic])
def list_tenants(session: SessionDep, _: AdminDep) -> list[TenantPublic]:
    return tenant_service.list_tenants(session=session)


@router.get("/{tenant}", response_model=TenantPublic)
def get_tenant(tenant: str, session: SessionDep, _: AdminDep) -> TenantPublic:
    return tenant_service.get_tenant(session=session, name=tenant)


@router.patch("/{tenant}", response_model=TenantPublic)
def update_tenant(tenant: str, body: TenantUpdate, session: SessionDep, ctx: CtxDep, _: AdminDep) -> TenantPublic:
    return tenant_service.update_tenant(session=session, ctx=ctx, name=tenant, changes=body)


@router.delete("/{tenant}", status_code=204)
def delete_tenant(tenant: str, session: SessionDep, ctx: CtxDep, _: AdminDep) -> Response:
    tenant_service.delete_tenant(session=session, ctx=ctx, name=tenant)
    return Response(status_code=204)


@router.post("/{tenant}/keys", response_model=ApiKeyCreated, status_code=201)
def create_key(tenant: str, session: SessionDep, ctx: CtxDep, _: AdminDep) -> ApiKeyCreated:
    return tenant_service.create_api_key(session=session, ctx=ctx, tenant_name=tenant)


@router.get("/{tenant}/keys", response_model=list[ApiKeyPublic])
def list_keys(tenant: str, session: SessionDep, _: AdminDep) -> list[ApiKeyPublic]:
    return tenant_service.list_api_keys(session=session, tenant_name=tenant)


@router.delete("/{tenant}/keys/{key_id}", status_code=204)
def revoke_key(tenant: str, key_id: int, session: SessionDep, ctx: CtxDep, _: AdminDep) -> Response:
    tenant_service.revoke_api_key(session=session, ctx=ctx, tenant_name=tenant, key_id=key_id)
    return Response(status_code=204)
