"""Tenants tab (admin): tenants with usage, create, edit limits (rates, adapters, and the
fair-scheduling weight and queueing limits), disable, delete; API keys.

Callbacks are ``fn(ctx, session, *form values)`` and call the platform's tenant
services, exactly as ``/admin/tenants`` does.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import InvalidRequest
from loraplex.platform.schemas import TenantCreate, TenantUpdate
from loraplex.platform.services import stats as stats_service
from loraplex.platform.services import tenants as tenant_service
from loraplex.ui.format import format_limit, format_number, format_time, ok_text
from loraplex.ui.session import ConsoleSession, require_admin
from loraplex.ui.wiring import on

TENANT_COLUMNS = ["tenant", "keys", "adapters", "requests/min", "tokens/min", "max adapters", "max upload MB",
                  "weight", "max concurrent", "max queued", "max queue s", "requests (24 h)", "tokens (24 h)", "requests (total)", "tokens (total)", "created (UTC)"]
KEY_COLUMNS = ["id", "prefix", "created (UTC)", "revoked (UTC)"]
USAGE_NOTE = ("Usage is counted per UTC day: the 24 h columns add up the days the last 24 hours touch "
              "(today and yesterday, UTC).")


def usage_window_start(now: dt.datetime) -> dt.date:
    """First UTC day counted as "last 24 h" at ``now``."""
    return (now - dt.timedelta(hours=24)).astimezone(dt.UTC).date()


# -- callbacks -------------------------------------------------------------------------------------
def tenants_table(ctx: PlatformContext, session: ConsoleSession | None, now: dt.datetime | None = None
                  ) -> pd.DataFrame:
    """One row per tenant: limits, key/adapter counts, usage over 24 h and in total."""
    require_admin(ctx, session)
    with ctx.sessions() as db:
        tenants = tenant_service.list_tenants(session=db)
        recent = stats_service.usage_by_tenant(session=db, since=usage_window_start(now or dt.datetime.now(dt.UTC)))
        total = stats_service.usage_by_tenant(session=db)
    rows = []
    for t in tenants:
        r, a = recent[t.name], total[t.name]
        rows.append([t.name, t.num_keys, t.num_adapters, format_limit(t.requests_per_minute),
                     format_limit(t.tokens_per_minute), t.max_adapters, t.max_upload_mb, t.weight,
                     format_limit(t.max_concurrent_requests), format_limit(t.max_queued_requests),
                     format_limit(t.max_queue_time_s), r.requests,
                     r.prompt_tokens + r.completion_tokens, a.requests, a.prompt_tokens + a.completion_tokens,
                     format_time(t.created_at)])
    return pd.DataFrame(rows, columns=TENANT_COLUMNS)


def tenant_names(ctx: PlatformContext, session: ConsoleSession | None) -> list[str]:
    require_admin(ctx, session)
    with ctx.sessions() as db:
        return [t.name for t in tenant_service.list_tenants(session=db)]


def tenant_choices(ctx: PlatformContext, session: ConsoleSession | None, selected: str | None = None) -> dict:
    """Dropdown update listing the tenants, ``selected`` chosen (None when it no longer exists)."""
    names = tenant_names(ctx, session)
    return gr.update(choices=names, value=selected if selected in names else None)


def refresh(ctx: PlatformContext, session: ConsoleSession | None, selected: str | None):
    """(tenants table, tenant dropdown, message)."""
    return tenants_table(ctx, session), tenant_choices(ctx, session, selected), ""


def blank_to_none(text: str | None) -> str | None:
    """A form field's text, None when empty (the schema then parses and checks it)."""
    text = (text or "").strip()
    return text or None


def _limits(requests_per_minute, tokens_per_minute, max_adapters, max_upload_mb, weight=None,
            max_concurrent_requests=None, max_queued_requests=None, max_queue_time_s=None) -> dict:
    """Form values as schema input; the fair-share fields only when the form has them (``None``
    = not on the form; an empty text = unlimited, for the weight = unchanged)."""
    values = {"requests_per_minute": blank_to_none(requests_per_minute),
              "tokens_per_minute": blank_to_none(tokens_per_minute), "max_adapters": blank_to_none(max_adapters),
              "max_upload_mb": blank_to_none(max_upload_mb)}
    for name, text in (("weight", weight), ("max_concurrent_requests", max_concurrent_requests),
                       ("max_queued_requests", max_queued_requests), ("max_queue_time_s", max_queue_time_s)):
        if text is not None:
            values[name] = blank_to_none(text)
    return values


def create_tenant(ctx: PlatformContext, session: ConsoleSession | None, name: str | None,
                  requests_per_minute: str | None, tokens_per_minute: str | None, max_adapters: str | None,
                  max_upload_mb: str | None, weight: str | None = None):
    """Create a tenant (empty limits take the server defaults, an empty weight is 1). Returns
    (table, dropdown, message).

    Raises ``pydantic.ValidationError`` (bad name or limit) and ``Conflict``.
    """
    require_admin(ctx, session)
    given = {k: v for k, v in _limits(requests_per_minute, tokens_per_minute, max_adapters, max_upload_mb,
                                      weight).items() if v is not None}
    spec = TenantCreate.model_validate({"name": (name or "").strip(), **given})
    with ctx.sessions() as db:
        created = tenant_service.create_tenant(session=db, ctx=ctx, spec=spec)
    return (tenants_table(ctx, session), tenant_choices(ctx, session, created.name),
            ok_text(f"tenant `{created.name}` created"))


def load_tenant(ctx: PlatformContext, session: ConsoleSession | None, name: str | None):
    """The selected tenant's limits and keys: (requests/min, tokens/min, max adapters,
    max upload MB, weight, max concurrent, max queued, max queue s, keys table, key dropdown,
    message); the message is left as it is."""
    require_admin(ctx, session)
    if not name:
        return ("", "", "", "", "", "", "", "", pd.DataFrame(columns=KEY_COLUMNS), gr.update(choices=[], value=None),
                gr.skip())
    with ctx.sessions() as db:
        t = tenant_service.get_tenant(session=db, name=name)
    keys, key_ids = keys_view(ctx, session, name)
    return (_field(t.requests_per_minute), _field(t.tokens_per_minute), _field(t.max_adapters),
            _field(t.max_upload_mb), _field(t.weight), _field(t.max_concurrent_requests),
            _field(t.max_queued_requests), _field(t.max_queue_time_s), keys, key_ids, gr.skip())


def save_limits(ctx: PlatformContext, session: ConsoleSession | None, name: str | None,
                requests_per_minute: str | None, tokens_per_minute: str | None, max_adapters: str | None,
                max_upload_mb: str | None, weight: str | None = None, max_concurrent_requests: str | None = None,
                max_queued_requests: str | None = None, max_queue_time_s: str | None = None):
    """Set the tenant's limits (an empty rate or queueing limit = unlimited; empty max adapters /
    upload size / weight = unchanged; ``None`` = not on the form, unchanged). Returns (table,
    message). Raises ``ValidationError``, ``NotFound``."""
    require_admin(ctx, session)
    name = _selected(name)
    changes = TenantUpdate.model_validate(_limits(requests_per_minute, tokens_per_minute, max_adapters,
                                                  max_upload_mb, weight, max_concurrent_requests,
                                                  max_queued_requests, max_queue_time_s))
    with ctx.sessions() as db:
        t = tenant_service.update_tenant(session=db, ctx=ctx, name=name, changes=changes)
    return tenants_table(ctx, session), ok_text(
        f"limits of `{t.name}` saved: {format_limit(t.requests_per_minute)} requests/min, "
        f"{format_limit(t.tokens_per_minute)} tokens/min, {t.max_adapters} adapters, {format_number(t.max_upload_mb)} MB uploads; "
        f"weight {format_number(t.weight)}, {format_limit(t.max_concurrent_requests)} concurrent, "
        f"{format_limit(t.max_queued_requests)} queued, {format_limit(t.max_queue_time_s)} s queue time")


def disable_tenant(ctx: PlatformContext, session: ConsoleSession | None, name: str | None):
    """Revoke all the tenant's keys. Returns (table, keys table, key dropdown, message)."""
    require_admin(ctx, session)
    name = _selected(name)
    with ctx.sessions() as db:
        count = tenant_service.disable_tenant(session=db, ctx=ctx, name=name)
    keys, key_ids = keys_view(ctx, session, name)
    return tenants_table(ctx, session), keys, key_ids, ok_text(
        f"`{name}` disabled: {count} key(s) revoked; create a key to enable it again")


def delete_tenant(ctx: PlatformContext, session: ConsoleSession | None, name: str | None):
    """Delete the tenant with its keys, adapters and usage. Returns (table, dropdown, confirm row, message)."""
    require_admin(ctx, session)
    name = _selected(name)
    with ctx.sessions() as db:
        tenant_service.delete_tenant(session=db, ctx=ctx, name=name)
    return (tenants_table(ctx, session), tenant_choices(ctx, session), gr.update(visible=False),
            ok_text(f"tenant `{name}` deleted"))


def ask_delete(ctx: PlatformContext, session: ConsoleSession | None, name: str | None):
    """Show the confirmation row. Returns (confirm row, confirm text, message)."""
    require_admin(ctx, session)
    name = _selected(name)
    question = f"**Delete tenant `{name}`** with all its keys, adapters and usage? This cannot be undone."
    return gr.update(visible=True), question, ""


def keys_view(ctx: PlatformContext, session: ConsoleSession | None, name: str) -> tuple[pd.DataFrame, dict]:
    """(keys table, dropdown of the active key ids)."""
    require_admin(ctx, session)
    with ctx.sessions() as db:
        keys = tenant_service.list_api_keys(session=db, tenant_name=name)
    table = pd.DataFrame([[k.id, k.prefix + "…", format_time(k.created_at), format_time(k.revoked_at)]
                          for k in keys], columns=KEY_COLUMNS)
    return table, gr.update(choices=[str(k.id) for k in keys if k.revoked_at is None], value=None)


def create_key(ctx: PlatformContext, session: ConsoleSession | None, name: str | None):
    """A new API key, shown once. Returns (key text box, keys table, key dropdown, table, message)."""
    require_admin(ctx, session)
    name = _selected(name)
    with ctx.sessions() as db:
        created = tenant_service.create_api_key(session=db, ctx=ctx, tenant_name=name)
    keys, key_ids = keys_view(ctx, session, name)
    return (gr.update(value=created.key, visible=True), keys, key_ids, tenants_table(ctx, session),
            ok_text(f"key {created.id} created for `{name}`: copy it now, it is not shown again"))


def revoke_key(ctx: PlatformContext, session: ConsoleSession | None, name: str | None, key_id: str | None):
    """Revoke one key. Returns (keys table, key dropdown, table, message). Raises ``NotFound``."""
    require_admin(ctx, session)
    name = _selected(name)
    if not key_id:
        raise InvalidRequest("choose the key to revoke", param="key_id")
    with ctx.sessions() as db:
        tenant_service.revoke_api_key(session=db, ctx=ctx, tenant_name=name, key_id=int(key_id))
    keys, key_ids = keys_view(ctx, session, name)
    return keys, key_ids, tenants_table(ctx, session), ok_text(f"key {key_id} of `{name}` revoked")


def _field(value: float | None) -> str:
    return "" if value is None else format_number(value)


def _selected(name: str | None) -> str:
    if not name:
        raise InvalidRequest("choose a tenant first", param="tenant")
    return name


# -- layout ----------------------------------------------------------------------------------------
@dataclass
class TenantsTab:
    tab: gr.Tab
    table: gr.Dataframe
    selected: gr.Dropdown
    message: gr.Markdown


def build(ctx: PlatformContext, state: gr.State) -> TenantsTab:
    """The Tenants tab's components and events (hidden until an admin signs in)."""
    with gr.Tab("Tenants", id="tenants", visible=False, elem_id="tab-tenants") as tab:
        message = gr.Markdown(elem_id="tenants-message")
        table = gr.Dataframe(headers=TENANT_COLUMNS, interactive=False, elem_id="tenants-table",
                             label="Tenants")
        gr.Markdown(USAGE_NOTE)
        refresh_btn = gr.Button("Refresh", size="sm")
        with gr.Accordion("Create a tenant", open=True):
            with gr.Row():
                new_name = gr.Textbox(label="Name", placeholder="acme", elem_id="new-tenant-name")
                new_rpm = gr.Textbox(label="Requests/min", placeholder="empty = server default")
                new_tpm = gr.Textbox(label="Tokens/min", placeholder="empty = server default")
                new_max_adapters = gr.Textbox(label="Max adapters", placeholder="empty = server default")
                new_max_mb = gr.Textbox(label="Max upload MB", placeholder="empty = server default")
                new_weight = gr.Textbox(label="Weight", placeholder="empty = 1", elem_id="new-tenant-weight")
            create_btn = gr.Button("Create tenant", variant="primary", elem_id="create-tenant")
        with gr.Accordion("Edit a tenant", open=True):
            selected = gr.Dropdown(label="Tenant", choices=[], elem_id="edit-tenant")
            with gr.Row():
                rpm = gr.Textbox(label="Requests/min", placeholder="empty = unlimited", elem_id="edit-rpm")
                tpm = gr.Textbox(label="Tokens/min", placeholder="empty = unlimited", elem_id="edit-tpm")
                max_adapters = gr.Textbox(label="Max adapters", elem_id="edit-max-adapters")
                max_mb = gr.Textbox(label="Max upload MB", elem_id="edit-max-upload-mb")
            with gr.Row():
                weight = gr.Textbox(label="Weight (fair-scheduling share)", elem_id="edit-weight")
                max_concurrent = gr.Textbox(label="Max concurrent requests", placeholder="empty = unlimited",
                                            elem_id="edit-max-concurrent")
                max_queued = gr.Textbox(label="Max queued requests", placeholder="empty = unlimited",
                                        elem_id="edit-max-queued")
                max_queue_s = gr.Textbox(label="Max queue time (s)", placeholder="empty = unlimited",
                                         elem_id="edit-max-queue-time")
            with gr.Row():
                save_btn = gr.Button("Save limits", variant="primary")
                disable_btn = gr.Button("Disable (revoke all keys)")
                delete_btn = gr.Button("Delete tenant…", variant="stop")
            with gr.Row(visible=False) as confirm_row:
                confirm_text = gr.Markdown()
                confirm_btn = gr.Button("Yes, delete", variant="stop", elem_id="confirm-delete-tenant")
                cancel_btn = gr.Button("Cancel")
            gr.Markdown("#### API keys")
            keys = gr.Dataframe(headers=KEY_COLUMNS, interactive=False, elem_id="keys-table")
            with gr.Row():
                create_key_btn = gr.Button("Create API key", elem_id="create-key")
                key_id = gr.Dropdown(label="Active key", choices=[])
                revoke_btn = gr.Button("Revoke key", variant="stop")
            new_key = gr.Textbox(label="New API key (shown once: copy it now)", visible=False, interactive=False,
                                 buttons=["copy"], elem_id="new-key")

    limits = [rpm, tpm, max_adapters, max_mb, weight, max_concurrent, max_queued, max_queue_s]
    on(refresh_btn.click, ctx, refresh, [state, selected], [table, selected, message])
    on(create_btn.click, ctx, create_tenant,
       [state, new_name, new_rpm, new_tpm, new_max_adapters, new_max_mb, new_weight],
       [table, selected, message])
    on(selected.change, ctx, load_tenant, [state, selected], [*limits, keys, key_id, message])
    selected.change(lambda: gr.update(value="", visible=False), outputs=[new_key], api_visibility="private")
    on(save_btn.click, ctx, save_limits, [state, selected, *limits], [table, message])
    on(disable_btn.click, ctx, disable_tenant, [state, selected], [table, keys, key_id, message])
    on(delete_btn.click, ctx, ask_delete, [state, selected], [confirm_row, confirm_text, message])
    cancel_btn.click(lambda: gr.update(visible=False), outputs=[confirm_row], api_visibility="private")
    on(confirm_btn.click, ctx, delete_tenant, [state, selected], [table, selected, confirm_row, message])
    on(create_key_btn.click, ctx, create_key, [state, selected], [new_key, keys, key_id, table, message])
    on(revoke_btn.click, ctx, revoke_key, [state, selected, key_id], [keys, key_id, table, message])
    return TenantsTab(tab=tab, table=table, selected=selected, message=message)
