"""Usage tab (tenant view): the signed-in tenant's limits and its requests and tokens."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import Unauthenticated
from loraplex.platform.services import stats as stats_service
from loraplex.platform.services import tenants as tenant_service
from loraplex.ui.format import format_limit, format_number
from loraplex.ui.session import ConsoleSession, check
from loraplex.ui.tenants_tab import USAGE_NOTE, usage_window_start
from loraplex.ui.wiring import on

USAGE_COLUMNS = ["period", "requests", "prompt tokens", "completion tokens", "total tokens"]


def own_usage(ctx: PlatformContext, session: ConsoleSession | None, now: dt.datetime | None = None):
    """(limits text, usage table: last 24 h and all time, message) of the signed-in tenant."""
    session = check(ctx, session)
    if session.is_admin:
        raise Unauthenticated("The admin sees every tenant's usage in the Tenants tab.")
    name = session.tenant_name
    with ctx.sessions() as db:
        tenant = tenant_service.get_tenant(session=db, name=name)
        recent = stats_service.usage_by_tenant(session=db, since=usage_window_start(now or dt.datetime.now(dt.UTC)))[name]
        total = stats_service.usage_by_tenant(session=db)[name]
    rows = [[period, u.requests, u.prompt_tokens, u.completion_tokens, u.prompt_tokens + u.completion_tokens]
            for period, u in (("last 24 h", recent), ("all time", total))]
    limits = (f"**{name}** — limits: {format_limit(tenant.requests_per_minute)} requests/min, "
              f"{format_limit(tenant.tokens_per_minute)} tokens/min, {tenant.num_adapters} of "
              f"{tenant.max_adapters} adapters, uploads up to {format_number(tenant.max_upload_mb)} MB")
    return limits, pd.DataFrame(rows, columns=USAGE_COLUMNS), ""


@dataclass
class UsageTab:
    tab: gr.Tab


def build(ctx: PlatformContext, state: gr.State) -> UsageTab:
    """The Usage tab (hidden until a tenant signs in)."""
    with gr.Tab("Usage", id="usage", visible=False, elem_id="tab-usage") as tab:
        message = gr.Markdown()
        limits = gr.Markdown(elem_id="usage-limits")
        table = gr.Dataframe(headers=USAGE_COLUMNS, interactive=False, elem_id="usage-table")
        gr.Markdown(USAGE_NOTE)
        refresh_btn = gr.Button("Refresh", size="sm")
    for event in (tab.select, refresh_btn.click):
        on(event, ctx, own_usage, [state], [limits, table, message])
    return UsageTab(tab=tab)
