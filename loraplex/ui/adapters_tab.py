"""Adapters tab: a tenant's adapters with where each one lives now, the upload workflow
(check -> confirm -> progress) and deletion with confirmation.

The admin picks any tenant; a tenant sees only its own adapters. Uploads go
through the platform's ``upload_adapter`` service (the same as
``POST /v1/adapters``), after a preview that runs its checks without storing.
"""

from __future__ import annotations


import contextlib
import logging
import mimetypes
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from loraplex.adapters import AdapterError
from loraplex.platform.async_engine import EngineStoppedError
from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import InvalidRequest, ModelNotFound
from loraplex.platform.schemas import AdapterPublic
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services.stats import engine_stats
from loraplex.platform.services.uploads import UploadPart
from loraplex.ui.format import error_text, format_bytes, format_time, ok_text
from loraplex.ui.session import ConsoleSession, acting_tenant, check
from loraplex.ui.wiring import SERVICE_ERRORS, on

ADAPTER_COLUMNS = ["adapter", "version", "type", "rank", "alpha", "target modules", "modules_to_save", "size",
                   "status", "uploaded (UTC)", "version id"]
Progress = Callable[..., object]
logger = logging.getLogger(__name__)
INVALIDATE_JS = "() => [{__type__: 'update', interactive: false}, '']"  # (confirm button, report)
UPLOAD_FIELDS = {"file": "the chosen files", "files": "the chosen files", "name": "the adapter name"}
"""The upload service's field names in the upload form's own words (for error messages)."""
CHOOSE_FILES = "choose one archive (.zip, .tar.gz) or the two files adapter_config.json and adapter_model.safetensors"


def _no_progress(fraction: float, desc: str | None = None) -> None:
    return None


# -- where an adapter lives ------------------------------------------------------------------------
def residency(lora_int_id: int, lora_name: str, lora_stats: dict | None) -> str:
    """"in GPU slot N" (with its pin count), "in CPU cache" or "stored", from the slot pool's stats
    (``SlotPoolStats`` as a dict: ``slots[i].lora_int_id/pin_count``, ``cpu_cache_lru`` names)."""
    if lora_stats:
        for slot in lora_stats.get("slots", []):
            if slot.get("lora_int_id") == lora_int_id:
                pins = slot.get("pin_count", 0)
                return f"in GPU slot {slot['slot']}" + (f" (pinned by {pins} running)" if pins else "")
        if lora_name in lora_stats.get("cpu_cache_lru", []):
            return "in CPU cache"
    return "stored"


def _status(ctx: PlatformContext, tenant_id: int, adapter: AdapterPublic, lora_stats: dict | None) -> str:
    if adapter.status == "broken":
        return "broken: stored files damaged, upload the original again"
    try:
        route = adapter_service.resolve_adapter(ctx=ctx, tenant_id=tenant_id, name=adapter.name)
    except ModelNotFound:  # deleted meanwhile
        return "deleted"
    return residency(route.lora_int_id, route.lora_name, lora_stats)


# -- callbacks -------------------------------------------------------------------------------------
def adapters_table(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None) -> pd.DataFrame:
    """The tenant's live adapters (``list_adapters``) with their residency in the engine."""
    tenant = acting_tenant(ctx, session, tenant_name)
    with ctx.sessions() as db:
        adapters = adapter_service.list_adapters(session=db, tenant_id=tenant.tenant_id)
    stats = engine_stats(ctx)
    lora_stats = stats.get("lora") if stats else None
    rows = [[a.name, a.version, a.adapter_type, a.rank, a.alpha, ", ".join(a.target_modules),
             ", ".join(a.modules_to_save), format_bytes(a.size_bytes), _status(ctx, tenant.tenant_id, a, lora_stats),
             format_time(a.created_at), a.version_id[:12]]
            for a in adapters]
    return pd.DataFrame(rows, columns=ADAPTER_COLUMNS)


def refresh(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None):
    """(adapters table, adapter dropdown, message); empty while the admin has chosen no tenant."""
    if not tenant_name and check(ctx, session).is_admin:
        return pd.DataFrame(columns=ADAPTER_COLUMNS), gr.update(choices=[], value=None), ""
    table = adapters_table(ctx, session, tenant_name)
    return table, gr.update(choices=list(table["adapter"]), value=None), ""


@contextlib.contextmanager
def open_parts(paths: Sequence[str] | str | None) -> Iterator[list[UploadPart]]:
    """The chosen files as upload parts (file name, content type guessed from it, size); closed on exit."""
    if not paths:
        raise InvalidRequest(CHOOSE_FILES, param="file")
    paths = [paths] if isinstance(paths, str) else list(paths)
    if len(paths) > 2:
        names = ", ".join(Path(p).name for p in paths)
        raise InvalidRequest(f"{CHOOSE_FILES}; {len(paths)} files were chosen ({names})", param="files")
    with contextlib.ExitStack() as stack:
        parts = []
        for path in map(Path, paths):
            content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
            parts.append(UploadPart(filename=path.name, content_type=content_type,
                                    fileobj=stack.enter_context(open(path, "rb")), size_bytes=path.stat().st_size))
        yield parts


def preview_text(preview: adapter_service.UploadPreview) -> str:
    """The validation report shown before confirming."""
    info = preview.info
    action = (f"replaces live version {preview.replaces_version}" if preview.replaces_version
              else "new adapter")
    kind = "DoRA" if info.use_dora else "LoRA"
    lines = [f"{ok_text(f'valid PEFT {kind} adapter')} — **{preview.name}** ({action})",
             f"- rank **{info.rank}** (server max {preview.max_lora_rank}), alpha {info.alpha:g}"
             + (", rsLoRA" if info.use_rslora else ""),
             f"- targets: {', '.join(info.target_modules) or 'none'} in {info.num_layers_targeted} layer(s)",
             f"- compatible with base model `{preview.base_model}`",
             f"- size {format_bytes(info.size_bytes)}, version id `{info.version_id[:16]}…`"]
    if info.modules_to_save:
        lines.insert(3, f"- modules_to_save (full copies): {', '.join(info.modules_to_save)}")
    lines += [f"- warning: {w}" for w in info.warnings]
    return "\n".join(lines)


def check_upload(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None, name: str | None,
                 paths: Sequence[str] | None):
    """Validate without storing. Returns (confirm button update, report); a refusal raises the
    service error (its message becomes the report)."""
    tenant = acting_tenant(ctx, session, tenant_name)
    with open_parts(paths) as parts, ctx.sessions() as db:
        preview = adapter_service.preview_upload(session=db, ctx=ctx, tenant=tenant, name=(name or "").strip(),
                                                 parts=parts)
    return gr.update(interactive=True), preview_text(preview)


def confirm_upload(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None, name: str | None,
                   paths: Sequence[str] | None, progress: Progress = _no_progress):
    """Store the upload (``upload_adapter``), then load it into the engine.
    Returns (table, adapter dropdown, confirm button update, message)."""
    tenant = acting_tenant(ctx, session, tenant_name)
    name = (name or "").strip()
    progress(0.1, desc="validating and storing")
    with open_parts(paths) as parts, ctx.sessions() as db:
        stored = adapter_service.upload_adapter(session=db, ctx=ctx, tenant=tenant, name=name, parts=parts)
    progress(0.6, desc="loading into the engine")
    loaded = _preload(ctx, tenant.tenant_id, name)
    progress(1.0, desc="done")
    table, names, _ = refresh(ctx, session, tenant_name)
    return table, names, gr.update(interactive=False), ok_text(
        f"`{stored.name}` version {stored.version} stored (rank {stored.rank}, "
        f"{format_bytes(stored.size_bytes)}); {loaded}")


def _preload(ctx: PlatformContext, tenant_id: int, name: str) -> str:
    try:
        loaded = adapter_service.preload_adapter(ctx=ctx, tenant_id=tenant_id, name=name)
    except (AdapterError, EngineStoppedError, FutureTimeout) as exc:
        logger.warning("console preload of adapter %r (tenant %d) failed: %s", name, tenant_id, exc)
        return "loading it into the engine failed; it will be loaded at its first request"
    return "loaded into the engine's CPU cache" if loaded else "no engine is running: loaded at first request"


def ask_delete(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
               adapter_name: str | None):
    """Show the confirmation row. Returns (confirm row, confirm text, message)."""
    acting_tenant(ctx, session, tenant_name)
    if not adapter_name:
        raise InvalidRequest("choose the adapter to delete", param="name")
    question = (f"**Delete adapter `{adapter_name}`** and all its versions? Requests already running on it "
                "finish first.")
    return gr.update(visible=True), question, ""


def delete_adapter(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
                   adapter_name: str | None):
    """Delete it (``delete_adapter``). Returns (table, adapter dropdown, confirm row, message)."""
    tenant = acting_tenant(ctx, session, tenant_name)
    if not adapter_name:
        raise InvalidRequest("choose the adapter to delete", param="name")
    with ctx.sessions() as db:
        adapter_service.delete_adapter(session=db, ctx=ctx, tenant_id=tenant.tenant_id, name=adapter_name)
    table, names, _ = refresh(ctx, session, tenant_name)
    return table, names, gr.update(visible=False), ok_text(f"adapter `{adapter_name}` deleted")


# -- layout ----------------------------------------------------------------------------------------
@dataclass
class AdaptersTab:
    tab: gr.Tab
    tenant: gr.Dropdown
    table: gr.Dataframe
    adapter: gr.Dropdown
    message: gr.Markdown


def build(ctx: PlatformContext, state: gr.State) -> AdaptersTab:
    """The Adapters tab's components and events.

    The upload form is reset after each check and each upload: the checked files move to
    ``pending`` (what "Upload" stores) and the file picker is emptied, so the next choice
    starts afresh instead of adding to the previous files. Every component, ``gr.State``
    included, is created inside the tab: one created beside it would take a place in the tab bar
    and push the next tab (Playground) out of it.
    """
    with gr.Tab("Adapters", id="adapters", elem_id="tab-adapters") as tab:
        pending = gr.State(None)  # the checked files, stored by "Upload" (inside the tab: see build's docstring)
        with gr.Row():
            tenant = gr.Dropdown(label="Tenant", choices=[], elem_id="adapters-tenant", scale=3)
            refresh_btn = gr.Button("Refresh", size="sm", scale=1)
        message = gr.Markdown(elem_id="adapters-message")
        table = gr.Dataframe(headers=ADAPTER_COLUMNS, interactive=False, elem_id="adapters-table",
                             label="Adapters (status: stored / in CPU cache / in GPU slot N)")
        with gr.Accordion("Upload an adapter", open=True):
            with gr.Row():
                name = gr.Textbox(label="Adapter name", placeholder="support-bot", elem_id="upload-name")
                files = gr.File(label="A .zip / .tar.gz archive, or adapter_config.json + adapter_model.safetensors",
                                file_count="multiple", type="filepath", elem_id="upload-files")
            with gr.Row():
                check_btn = gr.Button("Check", elem_id="upload-check")
                confirm_btn = gr.Button("Upload", variant="primary", interactive=False, elem_id="upload-confirm")
            report = gr.Markdown(elem_id="upload-report")
        with gr.Accordion("Delete an adapter", open=False):
            with gr.Row():
                adapter = gr.Dropdown(label="Adapter", choices=[], elem_id="delete-adapter-name")
                delete_btn = gr.Button("Delete…", variant="stop", elem_id="delete-adapter")
            with gr.Row(visible=False) as confirm_row:
                confirm_text = gr.Markdown()
                yes_btn = gr.Button("Yes, delete", variant="stop", elem_id="confirm-delete-adapter")
                no_btn = gr.Button("Cancel")

    def check(session, tenant_name, adapter_name, paths):
        """(confirm button, file picker, pending files, report)."""
        try:
            button, text = check_upload(ctx, session, tenant_name, adapter_name, paths)
        except SERVICE_ERRORS as exc:
            return gr.update(interactive=False), None, None, error_text(exc, UPLOAD_FIELDS)
        paths = [paths] if isinstance(paths, str) else list(paths)
        text += "\n- checked files: " + ", ".join(f"`{Path(p).name}`" for p in paths)
        return button, None, paths, text

    def confirm(session, tenant_name, adapter_name, paths, progress=gr.Progress()):  # noqa: B008
        """(table, adapter dropdown, confirm button, message, file picker, pending, name, report).
        Wired by hand: Gradio injects the progress tracker only into a parameter it can see."""
        reset = (None, None, "", "")
        try:
            return (*confirm_upload(ctx, session, tenant_name, adapter_name, paths, progress), *reset)
        except SERVICE_ERRORS as exc:
            return (gr.skip(), gr.skip(), gr.update(interactive=False), error_text(exc, UPLOAD_FIELDS), *reset)

    on(refresh_btn.click, ctx, refresh, [state, tenant], [table, adapter, message])
    on(tab.select, ctx, refresh, [state, tenant], [table, adapter, message])
    on(tenant.change, ctx, refresh, [state, tenant], [table, adapter, message])
    # In the browser, at once: a new choice needs a new check (user actions only: the resets
    # below change the picker too).
    for changed in (name.input, files.upload, files.clear, files.delete):
        changed(None, outputs=[confirm_btn, report], js=INVALIDATE_JS)
    check_btn.click(check, [state, tenant, name, files], [confirm_btn, files, pending, report],
                    api_visibility="private")
    confirm_btn.click(confirm, [state, tenant, name, pending],
                      [table, adapter, confirm_btn, message, files, pending, name, report], api_visibility="private")
    on(delete_btn.click, ctx, ask_delete, [state, tenant, adapter], [confirm_row, confirm_text, message])
    no_btn.click(lambda: gr.update(visible=False), outputs=[confirm_row], api_visibility="private")
    on(yes_btn.click, ctx, delete_adapter, [state, tenant, adapter], [table, adapter, confirm_row, message])
    return AdaptersTab(tab=tab, tenant=tenant, table=table, adapter=adapter, message=message)
