"""What ``GET /v1/models`` shows a tenant: the base model, then its live adapters."""

from __future__ import annotations

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import ModelNotFound
from loraplex.platform.openai_schemas import ModelCard, ModelList
from loraplex.platform.schemas import TenantContext
from loraplex.platform.services.adapters import cached_adapter_names


def list_models(*, ctx: PlatformContext, tenant: TenantContext) -> ModelList:
    """Base model (``parent`` None) and the tenant's ready adapters (``parent`` = base id),
    each with ``max_model_len``. Empty when no model is served."""
    if ctx.model_id is None or ctx.max_model_len is None:
        return ModelList(data=[])
    base = ModelCard(id=ctx.model_id, created=int(ctx.started_at), owned_by="loraplex", root=ctx.model_id,
                     parent=None, max_model_len=ctx.max_model_len)
    adapters = [ModelCard(id=a["name"], created=int(a["created_at"]), owned_by=tenant.tenant_name,
                          root=a["name"], parent=ctx.model_id, max_model_len=ctx.max_model_len)
                for a in cached_adapter_names(ctx=ctx, tenant_id=tenant.tenant_id)]
    return ModelList(data=[base, *adapters])


def get_model(*, ctx: PlatformContext, tenant: TenantContext, model_id: str) -> ModelCard:
    """The card :func:`list_models` shows for ``model_id``.

    Raises ``ModelNotFound`` (404) for any other id, another tenant's adapter included.
    """
    for card in list_models(ctx=ctx, tenant=tenant).data:
        if card.id == model_id:
            return card
    raise ModelNotFound(model_id)
