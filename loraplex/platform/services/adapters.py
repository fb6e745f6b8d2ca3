"""Adapter uploads, listing, deletion and model resolution (shared by the admin
API, the tenant API, the CLI and the console).

Upload flow: size/quota checks -> the uploaded bytes copied under
``<data_dir>/tmp/<random>/`` -> in a worker process with a deadline
(``validation.UploadValidator``): safe extraction of the two PEFT files
(``uploads.stage_upload``) and ``loraplex.adapters.validate_adapter_dir``
against the served base model and dtype -> the two files moved into the
content-addressed folder ``<data_dir>/adapters/<version_id>/`` (replacing the
files there, so uploading the original again repairs a damaged folder) ->
record a new version (the previous one becomes ``superseded``; broken versions
of the same content become ``ready`` again) -> invalidate cached lookups ->
retire the old version from the engine once its in-flight requests finish. A
refused upload leaves no row and no file behind.

Version statuses: ``ready`` (live), ``superseded`` (a newer version is live),
``broken`` (live, but its stored files failed the content-hash check when the
engine first read them: requests on it get 409 ``adapter_broken`` until the
original is uploaded again). ``clean_storage`` (at server start) removes
staging leftovers and folders no live version names: the registry is the truth.

Tenants see error messages without server paths or internal ids
(:func:`public_text`); the details go to the log.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.adapters import AdapterError, AdapterInfo
from loraplex.adapters.lora_request import LoRARequest
from loraplex.platform import crud
from loraplex.platform.context import PlatformContext
from loraplex.platform.db import session_scope
from loraplex.platform.errors import (
    AdapterBroken,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    PlatformError,
    ServiceUnavailable,
)
from loraplex.platform.lora_names import engine_lora_name
from loraplex.platform.models import AdapterVersion
from loraplex.platform.schemas import NAME_PATTERN, AdapterPublic, AdapterRoute, TenantContext
from loraplex.platform.services.uploads import PEFT_FILES, UploadLimits, UploadPart, remove_tree
from loraplex.platform.services.validation import StagedPart, UploadCheck, stage_parts

logger = logging.getLogger(__name__)
MB = 10**6
_CONTENT_HASH = re.compile(r"[0-9a-f]{64}")


def adapter_cache_keys(tenant_id: int, *names: str) -> list[str]:
    """Cache keys to drop when adapters of a tenant change."""
    return [f"adapters:{tenant_id}", *(f"adapter:{tenant_id}:{n}" for n in names)]


def version_public(name: str, version: AdapterVersion) -> AdapterPublic:
    return AdapterPublic(name=name, version=version.version, version_id=version.content_hash, rank=version.rank,
                         alpha=version.alpha, target_modules=list(version.target_modules),
                         size_bytes=version.size_bytes, status=version.status, created_at=version.created_at,
                         modules_to_save=list(version.modules_to_save or ()), adapter_type=version.adapter_type)


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
    ``loraplex.adapters`` — the message is its ``AdapterError`` without server paths —,
    or its check passed its deadline / memory cap), ``LimitExceeded`` (403: max adapters),
    ``PayloadTooLarge`` (413), ``UnsupportedMediaType`` (415), ``ServiceUnavailable``
    (503: no base model to validate against, every check worker busy, storage failing).
    """
    _check_ready(ctx, name)
    is_new = crud.get_adapter(session=session, tenant_id=tenant.tenant_id, name=name) is None
    if is_new and crud.count_adapters(session=session, tenant_id=tenant.tenant_id) >= tenant.max_adapters:
        raise _quota_reached(tenant)  # early answer; _record enforces the quota atomically
    staging, staged = _stage(ctx, tenant, parts)
    try:
        info = _validate(ctx, tenant, staging, staged)
        stored = _store(ctx, staging / _CHECKED, info.version_id)
        version, superseded, repaired = _record(session, ctx, tenant, name, info, stored)
    finally:
        remove_tree(staging)
    ctx.cache.invalidate(*adapter_cache_keys(tenant.tenant_id, name), *repaired)
    retire_versions(ctx, [(v.id, v.content_hash) for v in superseded])
    return version_public(name, version)


def _quota_reached(tenant: TenantContext) -> LimitExceeded:
    return LimitExceeded(f"tenant {tenant.tenant_name!r} has reached max_adapters={tenant.max_adapters}",
                         param="name")


def validate_upload(*, ctx: PlatformContext, tenant: TenantContext, name: str,
                    parts: list[UploadPart]) -> AdapterInfo:
    """Run every check of :func:`upload_adapter` except the quota, store nothing, and return
    the adapter's summary (the console's preview). Raises what ``upload_adapter`` raises."""
    _check_ready(ctx, name)
    staging, staged = _stage(ctx, tenant, parts)
    try:
        return _validate(ctx, tenant, staging, staged)
    finally:
        remove_tree(staging)


@dataclass(frozen=True)
class UploadPreview:
    """What an upload would store: the validated adapter, the live version it would supersede
    (None when the name is new), the base model and the largest rank served."""

    name: str
    info: AdapterInfo
    replaces_version: int | None
    base_model: str | None
    max_lora_rank: int


def preview_upload(*, session: Session, ctx: PlatformContext, tenant: TenantContext, name: str,
                   parts: list[UploadPart]) -> UploadPreview:
    """:func:`validate_upload` plus the live version the upload would supersede (the console's
    preview). Raises what :func:`upload_adapter` raises for its checks."""
    info = validate_upload(ctx=ctx, tenant=tenant, name=name, parts=parts)
    adapter = crud.get_adapter(session=session, tenant_id=tenant.tenant_id, name=name)
    live = crud.live_version(session=session, adapter_id=adapter.id) if adapter else None
    return UploadPreview(name=name, info=info, replaces_version=live.version if live else None,
                         base_model=ctx.model_id, max_lora_rank=ctx.max_lora_rank)


PRELOAD_TIMEOUT_S = 60.0


def preload_adapter(*, ctx: PlatformContext, tenant_id: int, name: str) -> bool:
    """Register the live version of the tenant's adapter in the engine (read from disk into the
    host-memory cache; ``AsyncEngine.preload_lora``), so its first request does not wait for the disk.

    Returns False when no engine with LoRA is running. Raises ``ModelNotFound`` for an unknown
    adapter, the engine's ``AdapterError`` for one it cannot load, ``TimeoutError`` after
    ``PRELOAD_TIMEOUT_S``.
    """
    route = resolve_adapter(ctx=ctx, tenant_id=tenant_id, name=name)
    engine = ctx.engine
    if engine is None or not engine.is_running or not engine.lora_enabled:
        return False
    engine.preload_lora(lora_request(route)).result(PRELOAD_TIMEOUT_S)
    return True


def _check_ready(ctx: PlatformContext, name: str) -> None:
    _check_name(ctx, name)
    if ctx.base_spec is None or ctx.max_lora_rank is None:
        raise ServiceUnavailable("no base model with LoRA enabled is loaded: adapters cannot be validated")


_INCOMING, _CHECKED = "incoming", "adapter"  # inside a staging folder: the uploaded bytes, the checked files


def _limits(ctx: PlatformContext, tenant: TenantContext) -> UploadLimits:
    s = ctx.settings
    return UploadLimits(max_bytes=int(min(tenant.max_upload_mb, s.max_upload_mb) * MB),
                        max_members=s.max_archive_members, max_compression_ratio=s.max_compression_ratio)


def _stage(ctx: PlatformContext, tenant: TenantContext,
           parts: list[UploadPart]) -> tuple[Path, tuple[StagedPart, ...]]:
    """A new staging folder holding the uploaded parts' bytes under ``incoming/``, and the parts.
    Raises ``PayloadTooLarge`` (413, before anything is written) or ``ServiceUnavailable``
    (503: the bytes could not be written; details logged)."""
    limits, total = _limits(ctx, tenant), sum(p.size_bytes for p in parts)
    if total > limits.max_bytes:
        raise PayloadTooLarge(f"upload is {total} bytes; the limit is {limits.max_bytes} bytes", param="file")
    staging = ctx.settings.uploads_tmp_dir / uuid.uuid4().hex
    try:
        staging.mkdir(parents=True)
        staged = stage_parts(parts, staging / _INCOMING)
    except OSError:
        remove_tree(staging)
        logger.exception("could not write an upload to %s", staging)
        raise ServiceUnavailable("the server could not store the upload; retry later",
                                 code="storage_unavailable") from None
    return staging, staged


def _validate(ctx: PlatformContext, tenant: TenantContext, staging: Path,
              staged: tuple[StagedPart, ...]) -> AdapterInfo:
    """Extract and check the staged upload in a worker process (``ctx.upload_validator``)."""
    job = UploadCheck(parts=staged, dest=str(staging / _CHECKED), limits=_limits(ctx, tenant), spec=ctx.base_spec,
                      max_lora_rank=ctx.max_lora_rank, serving_dtype=ctx.serving_dtype or torch.float32)
    try:
        info = ctx.upload_validator.run(job)
    except AdapterError as exc:
        raise InvalidRequest(public_text(ctx, str(exc), staging), param="file", code="invalid_adapter") from None
    except PlatformError as exc:
        exc.message = public_text(ctx, exc.message, staging)
        raise
    if len(info.modules_to_save) > ctx.max_full_module_slots:
        raise InvalidRequest(
            f"modules_to_save={list(info.modules_to_save)!r} needs {len(info.modules_to_save)} full-module slot(s) "
            f"(one [vocab_size, hidden_size] matrix each) but the server has max_full_module_slots="
            f"{ctx.max_full_module_slots} (--max-full-module-slots / LORAPLEX_MAX_FULL_MODULE_SLOTS)",
            param="file", code="invalid_adapter")
    return info


def _store(ctx: PlatformContext, checked: Path, version_id: str) -> bool:
    """Put the checked files in ``adapters/<version_id>``; True if that folder is new.

    An existing folder of the same content gets its two files replaced by the checked ones
    (each ``os.replace`` is atomic; a reader holding the old file keeps reading it), so
    uploading the original again repairs a folder damaged on disk.
    """
    target = ctx.settings.adapters_dir / version_id
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(checked, target)
        return True
    except OSError:  # the folder exists (stored earlier, or another upload of the same content won a race)
        if not target.is_dir():
            raise
    for name in PEFT_FILES:
        os.replace(checked / name, target / name)
    return False


def _record(session: Session, ctx: PlatformContext, tenant: TenantContext, name: str, info: AdapterInfo,
            stored: bool) -> tuple[AdapterVersion, list[AdapterVersion], list[str]]:
    """Record the version; returns it, the versions it superseded, and the cache keys of the
    broken versions of the same content that the stored files repaired."""
    try:
        version, superseded = crud.add_adapter_version(
            session=session, tenant_id=tenant.tenant_id, name=name, content_hash=info.version_id,
            rank=info.rank, alpha=info.alpha, target_modules=list(info.target_modules), size_bytes=info.size_bytes,
            max_adapters=tenant.max_adapters, modules_to_save=info.modules_to_save, adapter_type=info.adapter_type)
        repaired = crud.repair_versions(session=session, content_hash=info.version_id)
        session.commit()
    except LimitExceeded:  # another upload took the last place while this one was being checked
        session.rollback()
        if stored:
            _delete_files_if_unused(ctx, info.version_id)
        raise _quota_reached(tenant) from None
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
    if repaired:
        logger.info("upload of content %s repaired %d broken version(s)", info.version_id, len(repaired))
    keys = [key for tenant_id, adapter_name in repaired for key in adapter_cache_keys(tenant_id, adapter_name)]
    return version, superseded, keys


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
    """The live version of the tenant's adapter ``name`` (read through the cache); its
    ``status`` may be ``broken`` (see :func:`servable_route`).

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
                lora_name=engine_lora_name(tenant_id, name, version.version),
                lora_path=str((ctx.settings.adapters_dir / version.content_hash).resolve()),
                created_at=version.created_at, status=version.status).model_dump(mode="json")

    data = ctx.cache.get_or_load(f"adapter:{tenant_id}:{name}", load)
    if data is None:
        raise ModelNotFound(name)
    return AdapterRoute.model_validate(data)


def servable_route(*, ctx: PlatformContext, tenant_id: int, name: str) -> AdapterRoute:
    """:func:`resolve_adapter`, refusing a broken version with ``AdapterBroken`` (409)."""
    route = resolve_adapter(ctx=ctx, tenant_id=tenant_id, name=name)
    if route.status == crud.BROKEN:
        raise AdapterBroken(name)
    return route


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


# -- broken versions -------------------------------------------------------------------------------
def mark_broken(ctx: PlatformContext, *, tenant_id: int, name: str, lora_int_id: int, detail: str) -> None:
    """Record that the engine could not read version ``lora_int_id`` of the tenant's adapter
    ``name`` from its stored folder (content hash mismatch, damaged or missing files): its
    status becomes ``broken`` (shown by the API and the console) and its requests get 409
    ``adapter_broken`` until the original is uploaded again. ``detail`` goes to the log only."""
    logger.error("adapter %r of tenant %d (version row %d) is broken: %s", name, tenant_id, lora_int_id, detail)
    with session_scope(ctx.sessions) as session:
        crud.mark_version_broken(session=session, version_id=lora_int_id)
    ctx.cache.invalidate(*adapter_cache_keys(tenant_id, name))


# -- storage at start ------------------------------------------------------------------------------
def clean_storage(ctx: PlatformContext) -> tuple[list[str], list[str]]:
    """Remove what an interrupted upload (e.g. ``kill -9``) may leave: everything under
    ``<data_dir>/tmp/`` and every folder under ``<data_dir>/adapters/`` that no ready or broken
    version names (the registry is the source of truth). For server start, before any
    upload runs. Returns (removed staging entries, removed adapter folders), names only."""
    settings = ctx.settings
    removed_tmp = _remove_children(settings.uploads_tmp_dir, keep=set())
    with ctx.sessions() as session:
        referenced = crud.stored_content_hashes(session=session)
    removed_folders = _remove_children(settings.adapters_dir, keep=referenced)
    if removed_tmp or removed_folders:
        logger.warning("startup cleanup: removed %d staging leftover(s) and %d orphan adapter folder(s) %s",
                       len(removed_tmp), len(removed_folders), removed_folders)
    return removed_tmp, removed_folders


def _remove_children(root: Path, *, keep: set[str]) -> list[str]:
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        if entry.name in keep:
            continue
        if entry.is_dir() and not entry.is_symlink():
            remove_tree(entry)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry.name)
    return removed


# -- what tenants see ------------------------------------------------------------------------------
def public_text(ctx: PlatformContext, text: str, *folders: Path) -> str:
    """``text`` without server paths: each of ``folders`` (e.g. an upload's staging folder)
    becomes ``<upload>``, and the data and cache folders (absolute or as configured)
    ``<data_dir>`` / ``<cache_dir>``."""
    replacements = [(str(folder), "<upload>") for folder in folders]
    replacements += [(str(folder.resolve()), "<upload>") for folder in folders]
    for root, label in ((ctx.settings.data_dir, "<data_dir>"), (ctx.settings.cache_dir, "<cache_dir>")):
        replacements += [(str(root.resolve()), label), (str(root), label)]
    for old, new in sorted(replacements, key=lambda pair: -len(pair[0])):
        if old and old != ".":
            text = text.replace(old, new)
    return text
