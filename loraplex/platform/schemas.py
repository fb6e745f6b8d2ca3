"""Request/response models of the registry (admin and tenant adapter APIs).

The OpenAI-compatible serving models live in ``openai_schemas.py``.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Tenant and adapter names: URL- and file-safe, 1-64 characters.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, min_length=1, max_length=64,
                            description="1-64 characters: letters, digits, '.', '_', '-' (first: letter/digit).")]


_WEIGHT = "Fair-scheduler share (priority tier): weight 2 gets twice the service of weight 1 when both wait."
_MAX_CONCURRENT = "Requests of this tenant in the engine at once; more wait in its queue. None = unlimited."
_MAX_QUEUED = "Requests waiting beyond max_concurrent_requests; more get 429 with Retry-After. None = unlimited."
_MAX_QUEUE_TIME = "Seconds a request may wait before its first scheduling step; then 503 with Retry-After."


class TenantLimits(BaseModel):
    """Per-tenant limits; ``None`` for a rate means unlimited."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_adapters: int | None = Field(None, ge=0, description="None = the server default.")
    max_upload_mb: float | None = Field(None, gt=0, description="MB = 10**6 bytes; None = the server default.")
    weight: float = Field(1.0, gt=0, le=1000, description=_WEIGHT)
    max_concurrent_requests: int | None = Field(None, ge=1, description=_MAX_CONCURRENT)
    max_queued_requests: int | None = Field(None, ge=0, description=_MAX_QUEUED)
    max_queue_time_s: float | None = Field(None, gt=0, description=_MAX_QUEUE_TIME)


class TenantCreate(TenantLimits):
    model_config = ConfigDict(extra="forbid")

    name: Name


class TenantUpdate(BaseModel):
    """Only the fields present change; an explicit ``null`` rate or queueing limit means unlimited."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    max_adapters: int | None = Field(None, ge=0)
    max_upload_mb: float | None = Field(None, gt=0)
    weight: float | None = Field(None, gt=0, le=1000, description=_WEIGHT)
    max_concurrent_requests: int | None = Field(None, ge=1, description=_MAX_CONCURRENT)
    max_queued_requests: int | None = Field(None, ge=0, description=_MAX_QUEUED)
    max_queue_time_s: float | None = Field(None, gt=0, description=_MAX_QUEUE_TIME)


class TenantPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_adapters: int
    max_upload_mb: float
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    max_queue_time_s: float | None = None
    created_at: dt.datetime
    num_keys: int = 0
    num_adapters: int = 0


class ApiKeyPublic(BaseModel):
    """A key as listed: prefix and dates only, never the key."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    prefix: str
    created_at: dt.datetime
    revoked_at: dt.datetime | None


class ApiKeyCreated(ApiKeyPublic):
    """Returned once, at creation: ``key`` is the bearer token and is not stored."""

    key: str


class AdapterPublic(BaseModel):
    """An adapter's live version. ``version`` counts uploads of this name (1, 2, ...);
    ``version_id`` is the content hash naming its stored folder; ``adapter_type``: ``lora`` or
    ``dora`` (a DoRA adapter, PEFT ``use_dora``)."""

    name: str
    version: int
    version_id: str
    rank: int
    alpha: float
    target_modules: list[str]
    size_bytes: int
    status: str
    created_at: dt.datetime
    modules_to_save: list[str] = []
    """Modules the adapter replaces by a full copy (PEFT ``modules_to_save``: ``embed_tokens``, ``lm_head``)."""
    adapter_type: Literal["lora", "dora"] = "lora"


class TenantContext(BaseModel):
    """What an authenticated tenant request carries (cached per key hash)."""

    tenant_id: int
    tenant_name: str
    key_id: int
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_adapters: int
    max_upload_mb: float
    weight: float = 1.0
    max_concurrent_requests: int | None = None
    max_queued_requests: int | None = None
    max_queue_time_s: float | None = None


class AdapterRoute(BaseModel):
    """What serving needs to run a tenant's adapter: the engine's ``lora_int_id`` (the
    version's id, never reused), a unique ``lora_name``, the folder and the version's status."""

    name: str
    version: int
    lora_int_id: int
    lora_name: str
    lora_path: str
    created_at: dt.datetime
    status: str = "ready"


class UsagePublic(BaseModel):
    tenant: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


class StatsPublic(BaseModel):
    """``GET /admin/stats``."""

    engine: dict[str, Any] | None
    adapter_slots: dict[str, Any] | None
    cache: dict[str, Any]
    tenants: list[UsagePublic]


class EvaluationPublic(BaseModel):
    """One stored evaluation of an adapter version against the base model (``GET /v1/evaluations``).

    ``accuracy`` / ``base_accuracy``: fraction of items correct (0..1); ``mean_loglik`` /
    ``base_mean_loglik``: mean over items of the answer's (reference's) summed token
    log-likelihood in nats. ``examples``: ``{"prompt", "expected", "base", "adapter"}`` dicts.
    """

    run_id: str
    tenant: str
    adapter: str
    version: int
    version_id: str
    eval_set_name: str
    eval_set_sha256: str
    task: str
    num_items: int
    accuracy: float
    mean_loglik: float
    base_model: str
    base_accuracy: float
    base_mean_loglik: float
    examples: list[dict[str, Any]]
    created_at: dt.datetime
