"""``Annotated`` dependencies: the platform context, a DB session, the caller's identity.

The sync ones run in FastAPI's thread pool (they touch the database / Redis).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from loraplex.platform.context import PlatformContext
from loraplex.platform.schemas import TenantContext
from loraplex.platform.services import tenants as tenant_service

_tenant_bearer = HTTPBearer(auto_error=False, scheme_name="TenantKey",
                            description="A tenant API key: `Authorization: Bearer lpx-...`.")
_admin_bearer = HTTPBearer(auto_error=False, scheme_name="AdminKey",
                           description="The admin key (LORAPLEX_ADMIN_KEY, or the one printed at first start).")


def get_ctx(request: Request) -> PlatformContext:
    return request.app.state.ctx


CtxDep = Annotated[PlatformContext, Depends(get_ctx)]


def get_session(ctx: CtxDep) -> Iterator[Session]:
    with ctx.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def current_tenant(request: Request, ctx: CtxDep, credentials: Annotated[HTTPAuthorizationCredentials | None,
                                                                          Depends(_tenant_bearer)]) -> TenantContext:
    """The authenticated tenant (already settled from the headers by ``guards.RequestGuard`` for
    requests with a body). Raises ``Unauthenticated`` (401)."""
    settled = getattr(request.state, "tenant", None)
    if isinstance(settled, TenantContext):
        return settled
    return tenant_service.authenticate_tenant(ctx=ctx, token=credentials.credentials if credentials else None)


CurrentTenant = Annotated[TenantContext, Depends(current_tenant)]


def require_admin(ctx: CtxDep, credentials: Annotated[HTTPAuthorizationCredentials | None,
                                                       Depends(_admin_bearer)]) -> None:
    """Raises ``Unauthenticated`` (401) unless the bearer key is the admin key."""
    tenant_service.authenticate_admin(ctx=ctx, token=credentials.credentials if credentials else None)


AdminDep = Annotated[None, Depends(require_admin)]


def require_metrics_reader(ctx: CtxDep, credentials: Annotated[HTTPAuthorizationCredentials | None,
                                                               Depends(_admin_bearer)]) -> None:
    """Raises ``Unauthenticated`` (401) unless the bearer key is the admin key or ``metrics_key``."""
    tenant_service.authenticate_metrics_reader(ctx=ctx, token=credentials.credentials if credentials else None)


MetricsReaderDep = Annotated[None, Depends(require_metrics_reader)]
