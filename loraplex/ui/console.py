"""The Gradio admin console and chat playground, mounted on the platform's FastAPI app.

    app = create_app(settings, engine)
    mount_console(app)            # console at /ui, same port as the API

The console holds no logic of its own: every callback calls the platform's
service functions with ``app.state.ctx`` (the :class:`PlatformContext` the
REST routes use). Sign-in asks for a key: the admin key opens every tab; a
tenant API key opens that tenant's Adapters, Playground, Evaluate and Usage tabs. Signing in
opens a console session (``session.ConsoleSessions``, carried by an HttpOnly cookie; see
``gate.py``); a page reload resumes it until "Sign out" or its lifetime ends.
"""

from __future__ import annotations

import gradio as gr
from fastapi import FastAPI

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import Unauthenticated
from loraplex.platform.services.adapters import MB
from loraplex.ui import adapters_tab, evaluate_tab, playground_tab, stats_tab, tenants_tab, usage_tab
from loraplex.ui.gate import install_gate
from loraplex.ui.session import COOKIE, ConsoleSession, ConsoleSessions, login
from loraplex.ui.stats_tab import StatsHistory
from loraplex.ui.wiring import on, with_error_message

CONSOLE_PATH = "/ui"
REFRESH_S = 2.0
CSS = """
.gradio-container { max-width: 1400px !important; }
#whoami p { margin: 0; }
#login-panel { max-width: 520px; margin: 48px auto; }
"""


def console_theme() -> gr.themes.Base:
    """A theme using the system font stack (no web fonts: the console works offline)."""
    return gr.themes.Soft(primary_hue="indigo", secondary_hue="slate",
                          font=["ui-sans-serif", "system-ui", "Segoe UI", "Helvetica", "Arial", "sans-serif"],
                          font_mono=["ui-monospace", "SFMono-Regular", "Menlo", "monospace"])


def sign_in(ctx: PlatformContext, key: str | None):
    """Outputs of the Sign in button: (session, login panel, main panel, who-am-I, key box,
    Tenants tab, Cache & engine tab, Usage tab, tabs, timer, Adapters tenant, Playground tenant, message).

    Raises ``Unauthenticated`` with the platform's message for a wrong key.
    """
    return signed_in_view(ctx, login(ctx, key))


def signed_in_view(ctx: PlatformContext, session: ConsoleSession):
    """The outputs of :func:`sign_in` for an open ``session``."""
    admin = session.is_admin
    who = "**admin**" if admin else f"tenant **{session.tenant_name}**"
    model = f" — serving `{ctx.model_id}`" if ctx.model_id else " — no model loaded (admin API only)"
    tenants = _tenant_dropdown(ctx, session)
    return (session, gr.update(visible=False), gr.update(visible=True), f"Signed in as {who}{model}", "",
            gr.update(visible=admin), gr.update(visible=admin), gr.update(visible=not admin),
            gr.update(selected="tenants" if admin else "adapters"), gr.Timer(active=admin),
            tenants, tenants, "")


def _tenant_dropdown(ctx: PlatformContext, session: ConsoleSession) -> dict:
    """Every tenant for the admin (none chosen); the tenant itself, fixed, for a tenant."""
    if not session.is_admin:
        return gr.update(choices=[session.tenant_name], value=session.tenant_name, interactive=False)
    return gr.update(choices=tenants_tab.tenant_names(ctx, session), value=None, interactive=True)


def after_sign_in(ctx: PlatformContext, session: ConsoleSession | None):
    """(tenants table, "Edit a tenant" dropdown, message): the admin's first view."""
    if session is None or not session.is_admin:
        return gr.skip(), gr.skip(), ""
    return tenants_tab.refresh(ctx, session, None)


def sign_in_with_session(ctx: PlatformContext, sessions: ConsoleSessions, key: str | None, token: str | None):
    """The Sign in button after its script opened the console session (``POST {path}/session``):
    the outputs of :func:`sign_in` for the session of the cookie ``token``, which must be the
    typed key's. Raises ``Unauthenticated``: the platform's message for a wrong key, or a note
    when the session cookie did not come back (cookies blocked)."""
    typed = login(ctx, key)  # the service's message for a wrong key
    try:
        session = sessions.resume(token)
    except Unauthenticated:
        session = None
    if session != typed:
        raise Unauthenticated("The console session could not be opened: allow cookies for this site and sign in "
                              "again.")
    return signed_in_view(ctx, session)


def resume(ctx: PlatformContext, sessions: ConsoleSessions, token: str | None):
    """On page load: the outputs of :func:`sign_in` for the console session of the cookie
    ``token`` (its key checked again); no change (the login form stays) when there is none."""
    try:
        return signed_in_view(ctx, sessions.resume(token))
    except Unauthenticated:
        return tuple(gr.skip() for _ in range(13))


def tenant_choices_for(ctx: PlatformContext, session: ConsoleSession | None, selected: str | None):
    """(tenant dropdown, message) for the Adapters / Playground tabs, refreshed when they open.
    The choice is left alone (the user may pick one meanwhile) unless its tenant is gone."""
    if session is None or not session.is_admin:
        return gr.skip(), ""
    names = tenants_tab.tenant_names(ctx, session)
    update = gr.update(choices=names)
    if selected and selected not in names:
        update["value"] = None
    return update, ""


def _session_js(path: str) -> tuple[str, str]:
    """(sign-in js, sign-out js): open / close the console session (``gate.py``) around Gradio's events."""
    sign_in = ("async (key) => { try { await fetch('%s/session', {method: 'POST', credentials: 'same-origin', "
               "headers: {Authorization: 'Bearer ' + (key || '').trim()}}); } catch (e) {} return key; }" % path)
    sign_out = ("async () => { try { await fetch('%s/session', {method: 'DELETE', credentials: 'same-origin'}); } "
                "catch (e) {} window.location.reload(); }" % path)
    return sign_in, sign_out


def build_console(ctx: PlatformContext, *, refresh_s: float = REFRESH_S,
                  history: StatsHistory | None = None, path: str = CONSOLE_PATH,
                  sessions: ConsoleSessions | None = None) -> gr.Blocks:
    """The console's ``gr.Blocks`` over ``ctx`` for mounting at ``path`` (stats plots keep ``history``,
    default: the last 5 minutes; ``sessions``: the console sessions the gate checks, see
    :func:`mount_console`)."""
    history = history or StatsHistory(window_s=300.0, min_interval_s=min(1.0, refresh_s))
    sessions = ConsoleSessions(ctx) if sessions is None else sessions
    sign_in_js, sign_out_js = _session_js(path)
    # Uploaded files wait in Gradio's cache: delete them once older than console_file_lifetime_s
    # (checked every half of it, so none lives longer than 1.5 times it).
    lifetime_s = ctx.settings.console_file_lifetime_s
    with gr.Blocks(title="loraplex console", analytics_enabled=False,
                   delete_cache=(max(1, lifetime_s // 2), lifetime_s)) as blocks:
        state = gr.State(None)
        gr.Markdown("## loraplex console")
        with gr.Column(visible=True, elem_id="login-panel") as login_panel:
            key = gr.Textbox(label="Admin key or tenant API key", type="password", elem_id="login-key",
                             placeholder="lpx-…")
            login_btn = gr.Button("Sign in", variant="primary", elem_id="login-button")
            login_message = gr.Markdown(elem_id="login-message")
        with gr.Column(visible=False) as main_panel:
            with gr.Row(equal_height=True):
                whoami = gr.Markdown(elem_id="whoami")
                logout_btn = gr.Button("Sign out", size="sm", scale=0, elem_id="logout-button")
            with gr.Tabs() as tabs:
                tenants = tenants_tab.build(ctx, state)
                adapters = adapters_tab.build(ctx, state)
                stats = stats_tab.build(ctx, state, history, refresh_s)
                playground = playground_tab.build(ctx, state)
                evaluate_tab.build(ctx, state)
                usage = usage_tab.build(ctx, state)

        outputs = [state, login_panel, main_panel, whoami, key, tenants.tab, stats.tab, usage.tab, tabs, stats.timer,
                   adapters.tenant, playground.tenant, login_message]
        first_view = [tenants.table, tenants.selected, tenants.message]

        def on_sign_in(typed_key: str | None, request: gr.Request):
            return with_error_message(len(outputs), sign_in_with_session, ctx, sessions, typed_key,
                                      request.cookies.get(COOKIE))

        def on_load(request: gr.Request):
            return resume(ctx, sessions, request.cookies.get(COOKIE))

        for event in (login_btn.click, key.submit):
            signed_in = event(on_sign_in, inputs=[key], outputs=outputs, js=sign_in_js, api_visibility="private")
            on(signed_in.then, ctx, after_sign_in, [state], first_view)
        resumed = blocks.load(on_load, None, outputs, api_visibility="private", show_progress="hidden")
        on(resumed.then, ctx, after_sign_in, [state], first_view)
        on(adapters.tab.select, ctx, tenant_choices_for, [state, adapters.tenant], [adapters.tenant, adapters.message],
           show_progress="hidden")
        on(playground.tab.select, ctx, tenant_choices_for, [state, playground.tenant],
           [playground.tenant, playground.status], show_progress="hidden")
        logout_btn.click(None, js=sign_out_js)  # ends the console session (DELETE {path}/session), reloads
    blocks.queue(default_concurrency_limit=16)
    return blocks


def mount_console(app: FastAPI, *, path: str = CONSOLE_PATH, ctx: PlatformContext | None = None,
                  refresh_s: float = REFRESH_S) -> FastAPI:
    """Mount the console on ``app`` at ``path`` (``ctx`` defaults to ``app.state.ctx``).

    Gradio's uploads are capped at the server-wide ``max_upload_mb``; the services
    enforce each tenant's own cap. Nothing under ``path`` accepts data before sign-in
    (``gate.py``). Returns ``app``.
    """
    ctx = ctx or app.state.ctx
    sessions = install_gate(app, ctx, path=path)
    blocks = build_console(ctx, refresh_s=refresh_s, path=path, sessions=sessions)
    return gr.mount_gradio_app(app, blocks, path=path, theme=console_theme(), css=CSS, ssr_mode=False,
                               footer_links=[], show_error=True, mcp_server=False,
                               max_file_size=int(ctx.settings.max_upload_mb * MB))


__all__ = ["CONSOLE_PATH", "build_console", "mount_console", "sign_in"]
