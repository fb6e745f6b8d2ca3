"""The platform's shared objects, built once per app by :func:`build_context`.

Routes reach it through ``deps.py``; the Gradio console gets the same object
(``app.state.ctx``) and calls the same service functions with it.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from loraplex.platform import crud
from loraplex.platform.admission import TenantAdmission
from loraplex.platform.cache import LookupCache, Store, make_store
from loraplex.platform.core.limits import SharedLimit
from loraplex.platform.core.security import ADMIN_KEY_PREFIX, generate_key, hash_key
from loraplex.platform.db import make_db_engine, make_session_factory, session_scope, upgrade_database
from loraplex.platform.limits import RateLimiter
from loraplex.platform.metrics import PlatformMetrics
from loraplex.platform.settings import Settings
from loraplex.platform.usage import UsageWriter

if TYPE_CHECKING:
    import torch

    from loraplex.adapters import BaseModelSpec
    from loraplex.platform.engine_client import EngineClient
    from loraplex.platform.services.validation import UploadValidator

logger = logging.getLogger(__name__)


@dataclass
class PlatformContext:
    """Everything a service function may need.

    ``engine`` is None when the app serves no model (admin API only); then
    ``model_id``, ``max_model_len`` and ``base_spec`` are None too. ``serving_dtype``:
    the dtype adapters are served in (the engine's slot dtype), which uploads are checked
    against; ``upload_validator`` runs those checks in worker processes.
    ``evaluation_limit``: the engine requests all adapter evaluations together keep in
    flight at most (``settings.eval_max_concurrent_requests``).
    """

    settings: Settings
    db: sa.Engine
    sessions: sessionmaker[Session]
    store: Store
    cache: LookupCache
    limiter: RateLimiter
    metrics: PlatformMetrics
    admin_key_hash: str
    usage: UsageWriter
    engine: EngineClient | None = None
    model_id: str | None = None
    max_model_len: int | None = None
    base_spec: BaseModelSpec | None = None
    max_lora_rank: int | None = None
    max_full_module_slots: int = 0
    admission: TenantAdmission = field(default_factory=TenantAdmission)
    serving_dtype: torch.dtype | None = None
    upload_validator: UploadValidator | None = None
    started_at: float = field(default_factory=time.time)
    evaluation_limit: SharedLimit = field(init=False)

    def __post_init__(self) -> None:
        self.evaluation_limit = SharedLimit(self.settings.eval_max_concurrent_requests)


def build_context(settings: Settings, engine: EngineClient | None, *, out: TextIO = sys.stdout) -> PlatformContext:
    """Open the database (applying migrations), the store, the metrics, and settle the admin key."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    db = make_db_engine(settings.resolved_database_url)
    upgrade_database(db)
    sessions = make_session_factory(db)
    store = make_store(settings.redis_url, retry_s=settings.redis_retry_s)
    ctx = PlatformContext(
        settings=settings, db=db, sessions=sessions, store=store,
        cache=LookupCache(store, settings.cache_ttl_s), limiter=RateLimiter(store),
        metrics=PlatformMetrics(), admin_key_hash=_admin_key_hash(settings, sessions, out),
        usage=UsageWriter(sessions, max_entries=settings.usage_buffer_max_entries,
                          give_up_s=settings.usage_give_up_s),
        upload_validator=_upload_validator(settings))
    if engine is not None:
        attach_engine(ctx, engine)
    return ctx


def attach_engine(ctx: PlatformContext, engine: EngineClient) -> None:
    """Serve ``engine`` under ``settings.model_id`` (or the engine's model folder name)."""
    ctx.engine = engine
    ctx.model_id = ctx.settings.served_model_name or engine.model_name
    ctx.max_model_len = engine.max_model_len
    ctx.base_spec = engine.base_spec if engine.lora_enabled else None
    ctx.max_lora_rank = engine.max_lora_rank
    ctx.max_full_module_slots = engine.max_full_module_slots
    ctx.admission = TenantAdmission(clock=engine.clock)  # one timeline for gate and engine deadlines
    ctx.serving_dtype = engine.serving_dtype
    ctx.metrics.bind_engine(engine, model_name=ctx.model_id)
    ctx.metrics.bind_admission(ctx.admission)


def attach_model_spec(ctx: PlatformContext) -> None:
    """Without an engine (CLI uploads): read ``settings.model``'s config so uploads can be
    validated against it. Raises ``ValueError`` when no model is configured."""
    from transformers import AutoConfig

    from loraplex.adapters.model_spec import ModelSpec
    from loraplex.engine.config import EngineConfig, served_adapter_spec
    from loraplex.engine.demo_models import resolve_model

    settings = ctx.settings
    if not settings.model:
        raise ValueError("no base model to validate the adapter against: pass --model (the demo server's is "
                         "--model smollm2) or set LORAPLEX_MODEL")
    folder = resolve_model(settings.model, settings.cache_dir)
    # the modules the server serves (lora_target_modules), as its engine checks uploads
    ctx.base_spec = served_adapter_spec(settings.lora_target_modules,
                                        ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(folder))),
                                        vocab=(settings.tensor_parallel_size or 1) == 1)
    ctx.max_lora_rank = settings.max_lora_rank or EngineConfig.__dataclass_fields__["max_lora_rank"].default
    ctx.max_full_module_slots = settings.max_full_module_slots or 0
    ctx.model_id = settings.model_id
    ctx.serving_dtype = _strictest_dtype(settings.dtype)


def _strictest_dtype(dtype: str | None) -> torch.dtype:
    """The serving dtype for ``Settings.dtype`` without an engine: as named; ``auto`` (bfloat16
    on CUDA, float32 on CPU) checks against bfloat16, the narrower range of the two."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16}.get(dtype or "auto", torch.bfloat16)


def _upload_validator(settings: Settings) -> UploadValidator:
    from loraplex.platform.services.validation import UploadValidator

    memory_mb = settings.upload_check_memory_mb
    return UploadValidator(deadline_s=settings.upload_check_timeout_s,
                           max_concurrent=settings.max_concurrent_upload_checks,
                           memory_bytes=None if memory_mb is None else int(memory_mb * 10**6))


def _admin_key_hash(settings: Settings, sessions: sessionmaker[Session], out: TextIO) -> str:
    """The admin key's hash: from ``settings.admin_key``, else the stored one, else a new
    key generated now (its hash stored, the key printed once to ``out``)."""
    if settings.admin_key is not None:
        return hash_key(settings.admin_key.get_secret_value())
    with session_scope(sessions) as session:
        stored = crud.get_admin_key_hash(session=session)
        if stored is not None:
            return stored
        new = generate_key(ADMIN_KEY_PREFIX)
        crud.add_admin_key(session=session, key_hash=new.key_hash, prefix=new.prefix)
    print(f"loraplex: generated admin key (shown once, store it now): {new.plaintext}", file=out, flush=True)
    return new.key_hash
