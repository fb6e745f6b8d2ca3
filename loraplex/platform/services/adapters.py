"""Adapter uploads, listing, deletion and model resolution (shared by the admin
API, the tenant API, the CLI and the console).

Upload flow: size/quota checks -> safe staging of the two PEFT files
(``uploads.stage_upload``) -> ``loraplex.adapters.validate_adapter_dir``
against the served base model -> move to the content-addressed folder
``<data_dir>/adapters/<version_id>/`` -> record a new version (the previous
one becomes ``superseded``) -> invalidate cached lookups -> retire the old
version from the engine once its in-flight requests finish. A refused upload
leaves no row and no file behind.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from pathlib import Path

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.adapters import AdapterError, AdapterInfo, validate_adapter_dir
from loraplex.engine.lora_request import LoRARequest
from loraplex.platform import crud
from loraplex.platform.context import PlatformContext
from loraplex.platform.db import session_scope
from loraplex.platform.errors import (
    Conflict,
    InvalidRequest,
    LimitExceeded,
    ModelNotFound,
    NotFound,
    ServiceUnavailable,
)
from loraplex.platform.models import AdapterVersion
from loraplex.platform.schemas import NAME_PATTERN, AdapterPublic, AdapterRoute, TenantContext
from loraplex.platform.services.uploads import UploadLimits, UploadPart, remove_tree, stage_upload

logger = logging.getLogger(__name__)
MB = 10**6
_CONTENT_HASH = re.compile(r"[0-9a-f]{64}")


def adapter_cache_keys(tenant_id: int, *names: str) -> list[str]:
    """Cache keys to drop when adapters of a tenant change."""
    return [f"adapters:{tenant_id}", *(f"adapter:{tenant_id}:{n}" for n in names)]


def version_public(name: str, version: AdapterVersion) -> AdapterPublic:
    return AdapterPublic(name=name, version=version.version, version_id=version.content_hash, rank=version.rank,
                         alpha=version.alpha, target_modules=list(version.target_modules),
                         size_bytes=version.size_bytes, status=version.status, created_at=version.created_at)


def _not_found(name: str) -> NotFound:
    # The same body whether the name never existed or belongs to another tenant.
    return NotFound(f"adapter {name!r} does not exist", param="name", code="adapter_not_found")


def _check_name(ctx: PlatformContext, name: str) -> None:
    if not re.fullmatch(NAME_PATTERN, name or ""):
        raise InvalidRequest(f"name={name!r}: must be 1-64 characters of letters, digits, '.', '_', '-' "
                             "starting with a letter or digit", param="name")
    if ctx.model_id is not None and name == ctx.model_id:
        raise InvalidRequest(f"name={name!r}: is the base model's id", param="name")


# -- upload ----------------------------------------------------------------------------------------
def upload_adapter(*, session: Session, ctx: PlatformContext, tenant: TenantContext, name: str,
                   parts: list[UploadPart]) -> AdapterPublic:
    """Validate and store an upload as the new live version of ``tenant``'s adapter ``name``.

    Raises ``InvalidRequest`` (400: bad name, bad archive, adapter refused by
    ``loraplex.adapters`` — the message is its ``AdapterError``), ``LimitExceeded``
    (403: max adapters), ``PayloadTooLarge`` (413), ``UnsupportedMediaType`` (415),
    ``ServiceUnavailable`` (503: no base model to validate against).
    """
    _check_ready(ctx, name)
    is_new = crud.get_adapter(session=session, tenant_id=tenant.tenant_id, name=name) is None
    if is_new and crud.count_adapters(session=session, tenant_id=tenant.tenant_id) >= tenant.max_adapters:
        raise LimitExceeded(f"tenant {tenant.tenant_name!r} has reached max_adapters={tenant.max_adapters}",
                            param="name")
    staging = _stage(ctx, tenant, parts)
    try:
        info = _validate(ctx, staging)
        stored = _store(ctx, staging, info.version_id)
        version, superseded = _record(session, ctx, tenant, name, info, stored)
    finally:
        remove_tree(staging)
    ctx.cache.invalidate(*adapter_cache_keys(tenant.tenant_id, name))
    retire_versions(ctx, [(v.id, v.content_hash) for v in superseded])
    return version_public(name, version)


def validate_upload(*, ctx: PlatformContext, tenant: TenantContext, name: str,
                    parts: list[UploadPart]) -> AdapterInfo:
    """Run every check of :func:`upload_adapter` except the quota, store nothing, and return
    the adapter's summary (the console's preview). Raises what ``upload_adapter`` raises."""
    _check_ready(ctx, name)
    staging = _stage(ctx, tenant, parts)
    try:
        return _validate(ctx, staging)
    finally:
        remove_tree(staging)


def _check_ready(ctx: PlatformContext, name: str) -> None:
    _check_name(ctx, name)
    if ctx.base_spec is None or ctx.max_lora_rank is None:
        raise ServiceUnavailable("no base model with LoRA enabled is loaded: adapters cannot be validated")


def _stage(ctx: PlatformContext, tenant: TenantContext, parts: list[UploadPart]) -> Path:
    s = ctx.settings
    limits = UploadLimits(max_bytes=int(min(tenant.max_upload_mb, s.max_upload_mb) * MB),
                          max_members=s.max_archive_members, max_compression_ratio=s.max_compression_ratio)
    staging = s.uploads_tmp_dir / uuid.uuid4().hex
    staging.mkdir(parents=True)
    try:
        stage_upload(parts, staging, limits)
    except BaseException:
        remove_tree(staging)
        raise
    return staging


def _validate(ctx: PlatformContext, folder: Path) -> AdapterInfo:
    try:
        return validate_adapter_dir(folder, ctx.base_spec, ctx.max_lora_rank)
    except AdapterError as exc:
        raise InvalidRequest(str(exc), param="file", code="invalid_adapter") from None


def _store(ctx: PlatformContext, staging: Path, version_id: str) -> bool:
    """Move the staged folder to ``adapters/<version_id>``; False if that content was already stored."""
    target = ctx.settings.adapters_dir / version_id
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        return False
    try:
        os.replace(staging, target)
    except OSError:  # another upload of the same content won the race
        if not target.exists():
            raise
        return False
    return True


def _record(session: Session, ctx: PlatformContext, tenant: TenantContext, name: str, info: AdapterInfo,
            stored: bool) -> tuple[AdapterVersion, list[AdapterVersion]]:
    try:
        result = crud.add_adapter_version(
            session=session, tenant_id=tenant.tenant_id, name=name, content_hash=info.version_id,
            rank=info.rank, alpha=info.alpha, target_modules=list(info.target_modules), size_bytes=info.size_bytes)
        session.commit()
    except IntegrityError:
        session.rollback()
        if stored:
            _delete_files_if_unused(ctx, info.version_id)
        raise Conflict(f"adapter {name!r} is being uploaded concurrently; retry", param="name") from None
    except BaseException:
        session.rollback()
        if stored:
            _delete_files_if_unused(ctx, info.version_id)
        raise
    return result


# -- read ------------------------------------------------------------------------------------------
def list_adapters(*, session: Session, tenant_id: int) -> list[AdapterPublic]:
    """The tenant's adapters with their live versions, by name."""
    return [version_public(a.name, v) for a, v in crud.list_live_adapters(session=session, tenant_id=tenant_id)]


def get_adapter(*, session: Session, tenant_id: int, name: str) -> AdapterPublic:
    """Raises ``NotFound`` (same body for another tenant's adapter)."""
    adapter = crud.get_adapter(session=session, tenant_id=tenant_id, name=name)
    version = crud.live_version(session=session, adapter_id=adapter.id) if adapter else None
    if version is None:
        raise _not_found(name)
    return version_public(name, version)


def cached_adapter_names(*, ctx: PlatformContext, tenant_id: int) -> list[dict]:
    """``[{"name", "created_at"}]`` of the tenant's live adapters (read through the cache)."""
    def load() -> list[dict]:
        with ctx.sessions() as session:
            return [{"name": a.name, "created_at": v.created_at.timestamp()}
                    for a, v in crud.list_live_adapters(session=session, tenant_id=tenant_id)]

    return ctx.cache.get_or_load(f"adapters:{tenant_id}", load)


def resolve_adapter(*, ctx: PlatformContext, tenant_id: int, name: str) -> AdapterRoute:
    """The live version of the tenant's adapter ``name`` for serving (read through the cache).

    Raises ``ModelNotFound`` for unknown names and other tenants' adapters alike.
    """
    def load() -> dict | None:
        with ctx.sessions() as session:
            adapter = crud.get_adapter(session=session, tenant_id=tenant_id, name=name)
            version = crud.live_version(session=session, adapter_id=adapter.id) if adapter else None
            if version is None:
                return None
            return AdapterRoute(
                name=name, version=version.version, lora_int_id=version.id,
                lora_name=f"{tenant_id}/{name}@{version.version}",
                lora_path=str((ctx.settings.adapters_dir / version.content_hash).resolve()),
                created_at=version.created_at).model_dump(mode="json")

    data = ctx.cache.get_or_load(f"adapter:{tenant_id}:{name}", load)
    if data is None:
        raise ModelNotFound(name)
    return AdapterRoute.model_validate(data)


def lora_request(route: AdapterRoute) -> LoRARequest:
    """The engine's request for ``route``, declaring the registry's content hash as ``version_id``.

    Stored folders are content-addressed (``adapters/<content_hash>``, written once by
    ``_store`` and never modified), and ``content_hash`` is the ``version_id`` that
    ``validate_adapter_dir`` computed at upload, so the engine registers the adapter from
    its header alone and never re-hashes it. A folder not named by a sha256 hex declares nothing.
    """
    content_hash = Path(route.lora_path).name
    return LoRARequest(lora_name=route.lora_name, lora_int_id=route.lora_int_id, lora_path=route.lora_path,
                       version_id=content_hash if _CONTENT_HASH.fullmatch(content_hash) else None)


# -- delete ----------------------------------------------------------------------------------------
def delete_adapter(*, session: Session, ctx: PlatformContext, tenant_id: int, name: str) -> None:
    """Delete the adapter and all its versions; requests already running finish first, then
    the engine forgets it and its files are removed. Raises ``NotFound``."""
    adapter = crud.get_adapter(session=session, tenant_id=tenant_id, name=name)
    if adapter is None:
        raise _not_found(name)
    versions = [(v.id, v.content_hash) for v in crud.adapter_versions(session=session, adapter_id=adapter.id)]
    crud.delete_adapter(session=session, adapter=adapter)
    session.commit()
    ctx.cache.invalidate(*adapter_cache_keys(tenant_id, name))
    retire_versions(ctx, versions)


def retire_versions(ctx: PlatformContext, versions: list[tuple[int, str]]) -> None:
    """For each (lora_int_id, content hash): drop it from the engine once idle, then delete
    its folder unless a live version still uses that content."""
    for lora_int_id, content_hash in versions:
        def release(content_hash: str = content_hash) -> None:
            # Called on the engine thread: the database check runs elsewhere, so an
            # unreachable registry can never stall a step.
            threading.Thread(target=_delete_files_if_unused, args=(ctx, content_hash), daemon=True,
                             name="loraplex-release-adapter").start()

        if ctx.engine is not None and ctx.engine.is_running:
            ctx.engine.retire_lora(lora_int_id, release)
        else:
            _delete_files_if_unused(ctx, content_hash)


def _delete_files_if_unused(ctx: PlatformContext, content_hash: str) -> None:
    with session_scope(ctx.sessions) as session:
        in_use = crud.content_hash_in_use(session=session, content_hash=content_hash)
    if not in_use:
        remove_tree(ctx.settings.adapters_dir / content_hash)
