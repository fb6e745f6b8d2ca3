"""Chat playground: the base model or one of a tenant's adapters, sampling settings,
an optional JSON schema the reply must follow (OpenAI ``response_format`` of type
``json_schema``), replies streamed token by token, and a side-by-side mode (base model | adapter).

Each reply is an OpenAI chat request run by the platform's serving service
(``prepare_chat`` -> ``start`` -> ``stream_sse``), the same code path as
``POST /v1/chat/completions`` with ``stream: true``: model resolution, context
checks, rate limits and usage accounting (charged to the tenant) all apply.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import InvalidRequest, PlatformError, ServiceUnavailable
from loraplex.platform.openai_schemas import ChatCompletionRequest
from loraplex.platform.schemas import TenantContext
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import serving
from loraplex.ui.format import error_text
from loraplex.ui.session import ConsoleSession, acting_tenant, check
from loraplex.ui.wiring import SERVICE_ERRORS, on

History = list[dict[str, Any]]
DEFAULT_MAX_TOKENS = 64


@dataclass(frozen=True)
class SamplingSettings:
    """The playground's sampling controls (``seed`` None = random; ``json_schema`` None = free text)."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int | None = None
    system_prompt: str = ""
    json_schema: dict[str, Any] | None = None


def message_text(content: Any) -> str:
    """A chat message's text: a string, or Gradio's list of ``{"type": "text", "text": ...}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text", ""))
    return "".join(message_text(part) for part in content)


def chat_request(model: str, history: History, message: str, settings: SamplingSettings) -> ChatCompletionRequest:
    """The streaming chat request for ``message`` after ``history``. Raises ``ValidationError``."""
    messages = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt.strip() else []
    messages += [{"role": m["role"], "content": message_text(m.get("content"))} for m in history
                 if m.get("role") in ("user", "assistant")]
    messages.append({"role": "user", "content": message})
    body = {"model": model, "messages": messages, "stream": True, "temperature": settings.temperature,
            "top_p": settings.top_p, "max_tokens": settings.max_tokens, "seed": settings.seed}
    if settings.json_schema is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "playground", "schema": settings.json_schema,
                                                   "strict": True}}
    return ChatCompletionRequest.model_validate(body)


async def stream_reply(ctx: PlatformContext, tenant: TenantContext, body: ChatCompletionRequest
                       ) -> AsyncIterator[str]:
    """The reply's text so far, once per streamed chunk with new text.

    Raises the serving errors (``ModelNotFound``, ``ContextLengthExceeded``, ``RateLimited``,
    ``ServiceUnavailable``, ...), also those reported in-band after the stream started.
    """
    prep = await asyncio.to_thread(serving.prepare_chat, ctx=ctx, tenant=tenant, body=body)
    streams = await serving.start(ctx, prep)
    text = ""
    async for event in serving.stream_sse(ctx, prep, streams):
        payload = event.removeprefix("data: ").strip()
        if payload == "[DONE]":
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise PlatformError(chunk["error"]["message"], param=chunk["error"].get("param"))
        delta = "".join(c["delta"].get("content") or "" for c in chunk["choices"])
        if delta:
            text += delta
            yield text


def sampling_settings(system: str | None, temperature: float, top_p: float, max_tokens: float, seed: str | None,
                      json_schema: str | None = None) -> SamplingSettings:
    """The form's values; ``seed`` text must be a non-negative integer or empty; ``json_schema``
    text a JSON object (a JSON schema) or empty. Raises ``InvalidRequest``."""
    seed_text = (seed or "").strip()
    if seed_text and not seed_text.isdigit():
        raise InvalidRequest(f"seed={seed_text!r}: must be a non-negative integer, or empty for random",
                             param="seed")
    schema = None
    if (json_schema or "").strip():
        try:
            schema = json.loads(json_schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"JSON schema: not valid JSON ({exc})", param="json_schema") from None
        if not isinstance(schema, dict):
            raise InvalidRequest("JSON schema: must be a JSON object", param="json_schema")
    return SamplingSettings(temperature=float(temperature), top_p=float(top_p), max_tokens=int(max_tokens),
                            seed=int(seed_text) if seed_text else None, system_prompt=system or "",
                            json_schema=schema)


def _turn(history: History | None, message: str, reply: str) -> History:
    return [*(history or []), {"role": "user", "content": message}, {"role": "assistant", "content": reply}]


# -- callbacks -------------------------------------------------------------------------------------
def model_choices(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
                  selected: str | None = None) -> dict:
    """Dropdown update: the base model, then the tenant's adapters (``list_adapters``)."""
    tenant = acting_tenant(ctx, session, tenant_name)
    if ctx.model_id is None:
        raise ServiceUnavailable("no model is being served")
    with ctx.sessions() as db:
        names = [a.name for a in adapter_service.list_adapters(session=db, tenant_id=tenant.tenant_id)]
    choices = [(f"{ctx.model_id} (base model)", ctx.model_id), *((n, n) for n in names)]
    values = [value for _, value in choices]
    return gr.update(choices=choices, value=selected if selected in values else ctx.model_id)


def refresh_models(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
                   selected: str | None):
    """(model dropdown, message); no models while the admin has chosen no tenant."""
    if not tenant_name and check(ctx, session).is_admin:
        return gr.update(choices=[], value=None), "Choose a tenant: the replies are charged to it."
    return model_choices(ctx, session, tenant_name, selected), ""


async def chat(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None, model: str | None,
               message: str | None, history: History | None, settings: SamplingSettings
               ) -> AsyncIterator[tuple[History, str]]:
    """Stream one reply of ``model``: yields (history with the partial reply, status)."""
    message = _required_message(message)
    if not model:
        raise InvalidRequest("choose a model", param="model")
    tenant = await asyncio.to_thread(acting_tenant, ctx, session, tenant_name)
    body = chat_request(model, list(history or []), message, settings)
    yield _turn(history, message, ""), ""
    reply = ""
    async for reply in stream_reply(ctx, tenant, body):
        yield _turn(history, message, reply), ""
    yield _turn(history, message, reply), f"{len(reply)} characters from `{model}`"


async def chat_side_by_side(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
                            model: str | None, message: str | None, history_base: History | None,
                            history_adapter: History | None, settings: SamplingSettings
                            ) -> AsyncIterator[tuple[History, History, str]]:
    """Send ``message`` to the base model and to adapter ``model`` at once; yields
    (base history, adapter history, status) as either reply grows. A refusal of one side
    is shown in its chat; the other side still answers."""
    message = _required_message(message)
    if not model or model == ctx.model_id:
        raise InvalidRequest("choose an adapter to compare with the base model", param="model")
    tenant = await asyncio.to_thread(acting_tenant, ctx, session, tenant_name)
    bodies = {"base": chat_request(ctx.model_id, list(history_base or []), message, settings),
              "adapter": chat_request(model, list(history_adapter or []), message, settings)}
    replies = {"base": "", "adapter": ""}
    yield _turn(history_base, message, ""), _turn(history_adapter, message, ""), ""
    async for side, text in _merge({k: _reply_or_error(ctx, tenant, b) for k, b in bodies.items()}):
        replies[side] = text
        yield (_turn(history_base, message, replies["base"]), _turn(history_adapter, message, replies["adapter"]),
               "")
    yield (_turn(history_base, message, replies["base"]), _turn(history_adapter, message, replies["adapter"]),
           f"`{ctx.model_id}` and `{model}` answered")


def _required_message(message: str | None) -> str:
    if not (message or "").strip():
        raise InvalidRequest("type a message first", param="message")
    return message.strip()


async def _reply_or_error(ctx: PlatformContext, tenant: TenantContext, body: ChatCompletionRequest
                          ) -> AsyncIterator[str]:
    """:func:`stream_reply`, with a service error turned into the reply text."""
    text = ""
    try:
        async for text in stream_reply(ctx, tenant, body):
            yield text
    except SERVICE_ERRORS as exc:
        yield f"{text}\n\n{error_text(exc)}".strip()


async def _merge(sources: dict[str, AsyncIterator[str]]) -> AsyncIterator[tuple[str, str]]:
    """(key, item) from several async iterators as items arrive; closing cancels them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(key: str, source: AsyncIterator[str]) -> None:
        try:
            async for item in source:
                await queue.put((key, item))
        except Exception as exc:  # noqa: BLE001 - re-raised below, in the consumer
            await queue.put((key, exc))
        await queue.put((key, done))

    tasks = [asyncio.create_task(pump(key, source)) for key, source in sources.items()]
    try:
        remaining = len(tasks)
        while remaining:
            key, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield key, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- layout ----------------------------------------------------------------------------------------
@dataclass
class PlaygroundTab:
    tab: gr.Tab
    tenant: gr.Dropdown
    model: gr.Dropdown
    status: gr.Markdown


def build(ctx: PlatformContext, state: gr.State) -> PlaygroundTab:
    """The Playground tab's components and events."""
    max_tokens_limit = max(1, min(1024, (ctx.max_model_len or 2048) - 1))
    with gr.Tab("Playground", id="playground", elem_id="tab-playground") as tab, gr.Row():
        with gr.Column(scale=1, min_width=260):
            tenant = gr.Dropdown(label="Tenant", choices=[], elem_id="chat-tenant")
            model = gr.Dropdown(label="Model (base or adapter)", choices=[], elem_id="chat-model")
            side_by_side = gr.Checkbox(label="Side by side: base model | chosen adapter",
                                       elem_id="chat-side-by-side")
            system = gr.Textbox(label="System prompt", lines=2, elem_id="chat-system")
            temperature = gr.Slider(0.0, 2.0, value=0.7, step=0.05, label="Temperature (0 = greedy)",
                                    elem_id="chat-temperature")
            top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="Top-p", elem_id="chat-top-p")
            max_tokens = gr.Slider(1, max_tokens_limit, value=min(DEFAULT_MAX_TOKENS, max_tokens_limit), step=1,
                                   label="Max tokens", elem_id="chat-max-tokens")
            seed = gr.Textbox(label="Seed", placeholder="empty = random", elem_id="chat-seed")
            json_schema = gr.Textbox(label="JSON schema (the reply must follow it; empty = free text)", lines=3,
                                     placeholder='{"type": "object", "properties": {...}}',
                                     elem_id="chat-json-schema")
        with gr.Column(scale=3):
            status = gr.Markdown(elem_id="chat-status")
            with gr.Row():
                chat_base = gr.Chatbot(label="Base model", visible=False, elem_id="chat-base", height=420,
                                       render_markdown=False)
                chat_main = gr.Chatbot(label="Reply", elem_id="chat-main", height=420, render_markdown=False)
            message = gr.Textbox(label="Message", placeholder="Say something…", elem_id="chat-message")
            with gr.Row():
                send_btn = gr.Button("Send", variant="primary", elem_id="chat-send")
                clear_btn = gr.Button("Clear", elem_id="chat-clear")

    async def send(session, tenant_name, model_id, text, history_main, history_base, pair, system_prompt,
                   temp, nucleus, limit, seed_value, schema_text):
        outputs = 4  # chat_main, chat_base, message box, status
        try:
            settings = sampling_settings(system_prompt, temp, nucleus, limit, seed_value, schema_text)
            if pair:
                async for base, adapter, note in chat_side_by_side(ctx, session, tenant_name, model_id, text,
                                                                   history_base, history_main, settings):
                    yield adapter, base, "", note
            else:
                async for history, note in chat(ctx, session, tenant_name, model_id, text, history_main, settings):
                    yield history, gr.skip(), "", note
        except SERVICE_ERRORS as exc:
            yield (*[gr.skip()] * (outputs - 1), error_text(exc))

    inputs = [state, tenant, model, message, chat_main, chat_base, side_by_side, system, temperature, top_p,
              max_tokens, seed, json_schema]
    outputs = [chat_main, chat_base, message, status]
    for event in (send_btn.click, message.submit):
        event(send, inputs=inputs, outputs=outputs, api_visibility="private")
    clear_btn.click(lambda: ([], [], ""), outputs=[chat_main, chat_base, status], api_visibility="private",
                    queue=False)
    side_by_side.change(lambda pair: (gr.update(visible=pair), gr.update(label="Adapter" if pair else "Reply")),
                        inputs=[side_by_side], outputs=[chat_base, chat_main], api_visibility="private")
    on(tab.select, ctx, refresh_models, [state, tenant, model], [model, status])
    on(tenant.change, ctx, refresh_models, [state, tenant, model], [model, status])
    return PlaygroundTab(tab=tab, tenant=tenant, model=model, status=status)
