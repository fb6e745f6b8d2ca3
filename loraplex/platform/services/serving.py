"""OpenAI-compatible serving: request -> engine requests -> responses or SSE chunks.

1. :func:`prepare_completion` / :func:`prepare_chat` (sync; tokenizer work):
   resolve ``model`` (the base model's id, or one of the tenant's adapters,
   else 404 ``model_not_found``), build :class:`SamplingParams`, tokenize, check
   ``prompt_tokens + max_tokens <= max_model_len``.
2. :func:`run_to_completion` (one typed response) or :func:`stream_chunks` (typed
   chunks; the route encodes them as server-sent events). Each prompt of a request is
   one engine request with ``n`` completions; choice index = ``prompt_index * n +
   completion index``. The engine emits delta outputs (``output_kind="delta"``: each
   step's new tokens, text, logprobs); ``_Tracker`` appends them to each choice's
   state (no per-step copy of what came before) and the formatter
   (:class:`~loraplex.platform.services.openai_format.OpenAIFormatter.delta`) sends
   the text past what was sent (stop strings are held back by the engine); a
   choice's finish is sent once.
3. Rate limits are reserved at admission (``limits.RateLimiter.admit``: completions =
   prompts x n, tokens = prompts + max_tokens per completion) and settled with the tokens
   used; usage counters go to the background ``usage.UsageWriter`` (never on the response path).
   Each prompt passes the tenant's admission gate first (``ctx.admission``: concurrency,
   queue length and queue time limits; 429/503 with ``Retry-After``) and reaches the engine
   with the tenant's fair-scheduling share and queueing deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from loraplex.adapters import AdapterConflictError, AdapterError, AdapterNotServedError, UnknownAdapterError
from loraplex.engine.fairness import TenantShare
from loraplex.engine.input_processor import InvalidRequestError, ProcessedPrompt
from loraplex.adapters.lora_request import LoRARequest
from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.platform.admission import retry_after_s
from loraplex.platform.async_engine import AsyncEngine, EngineStoppedError, RequestStream
from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import (
    AdapterBroken,
    ClientDisconnected,
    InternalError,
    InvalidRequest,
    PlatformError,
    ServiceUnavailable,
)
from loraplex.platform.limits import Admission, reserved_tokens
from loraplex.platform.openai_schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionChunk,
    CompletionRequest,
    DeltaMessage,
    ErrorResponse,
    Usage,
)
from loraplex.platform.schemas import TenantContext
from loraplex.platform.services import input_errors, structured, tool_calls  # structured output / tool calling hooks
from loraplex.platform.services.adapters import lora_request, mark_broken, servable_route
from loraplex.platform.services.chat_prompt import chat_prompt_ids
from loraplex.platform.services.openai_format import ChoiceProgress, OpenAIFormatter, TokenText, token_text

logger = logging.getLogger(__name__)
Kind = Literal["completion", "chat"]


@dataclass
class PreparedRequest:
    """A validated serving request, ready for the engine."""

    kind: Kind
    id: str
    created: int
    model: str
    adapter_label: str
    tenant: TenantContext
    prompts: list[ProcessedPrompt]
    params: SamplingParams
    lora: LoRARequest | None
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    tokens: TokenText
    echo: bool = False
    prompt_logprobs: int | None = None
    started: float = field(default_factory=time.monotonic)
    tools: tool_calls.ToolPlan | None = None  # tool calling hook: parses text into tool_calls
    admission: Admission | None = None
    gate_wait_s: float = 0.0  # time spent in the tenant's admission queue

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the engine computes prompt logprobs (echo with logprobs, or ``prompt_logprobs``)."""
        return self.params.prompt_logprobs is not None


# -- preparation -----------------------------------------------------------------------------------
def prepare_completion(*, ctx: PlatformContext, tenant: TenantContext, body: CompletionRequest) -> PreparedRequest:
    """Raises ``InvalidRequest``/``ContextLengthExceeded`` (400), ``ModelNotFound`` (404), ``ServiceUnavailable``.

    ``echo``: the prompt (decoded from its tokens) precedes the text, and with ``logprobs``
    its tokens precede the generated ones (the first prompt token's logprob is None).
    """
    engine = _require_engine(ctx)
    _refuse_unsupported(suffix=body.suffix, logit_bias=body.logit_bias,
                        best_of=body.best_of if body.best_of not in (None, body.n) else None)
    lora, label = _resolve_model(ctx, tenant, body.model)
    echo_logprobs = body.logprobs if body.echo else None
    params = _sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                              prompt_logprobs=_max_or_none(body.prompt_logprobs, echo_logprobs))
    params = structured.constrain(engine, params, *structured.requested_constraint(body))  # hook
    prompts = _processed(engine, _completion_prompts(body.prompt, ctx.settings.max_prompts_per_request), params,
                         "prompt")
    return PreparedRequest("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.model, label, tenant,
                           prompts, params, lora, body.stream, _include_usage(body), body.logprobs,
                           token_text(engine.tokenizer), echo=body.echo, prompt_logprobs=body.prompt_logprobs)


def prepare_chat(*, ctx: PlatformContext, tenant: TenantContext, body: ChatCompletionRequest) -> PreparedRequest:
    """As :func:`prepare_completion`, with the tokenizer's chat template applied to ``messages``."""
    engine = _require_engine(ctx)
    _refuse_unsupported(logit_bias=body.logit_bias)
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest("top_logprobs: requires logprobs to be true", param="top_logprobs")
    lora, label = _resolve_model(ctx, tenant, body.model)
    max_tokens = body.max_completion_tokens or body.max_tokens
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _sampling_params(body, max_tokens=max_tokens, logprobs=top, prompt_logprobs=body.prompt_logprobs)
    tools = tool_calls.ToolPlan.from_request(body)  # tool calling hook
    params = structured.constrain(engine, params, *structured.chat_constraint(body, tools))  # hook
    prompt = _chat_prompt(engine, body, literal_content=not ctx.settings.chat_content_special_tokens)
    prompts = _processed(engine, [prompt], params, "messages")
    return PreparedRequest("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model, label, tenant,
                           prompts, params, lora, body.stream, _include_usage(body), top,
                           token_text(engine.tokenizer), prompt_logprobs=body.prompt_logprobs, tools=tools)


def _max_or_none(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _require_engine(ctx: PlatformContext) -> AsyncEngine:
    if ctx.engine is None:
        raise ServiceUnavailable("no model is being served")
    if not ctx.engine.is_running:
        raise ServiceUnavailable("the model's engine has stopped (the server log says why); restart the server")
    return ctx.engine


def _refuse_unsupported(**fields: Any) -> None:
    for name, value in fields.items():
        if value:
            raise InvalidRequest(f"{name}={value!r} is not supported by this server", param=name,
                                 code="unsupported_parameter")


def _resolve_model(ctx: PlatformContext, tenant: TenantContext, model: str) -> tuple[LoRARequest | None, str]:
    if model == ctx.model_id:
        return None, model
    route = servable_route(ctx=ctx, tenant_id=tenant.tenant_id, name=model)
    return lora_request(route), f"{tenant.tenant_name}/{model}"


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None,
                     logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
    values = dict(n=body.n, max_tokens=max_tokens, stop=body.stop, seed=body.seed, logprobs=logprobs,
                  prompt_logprobs=prompt_logprobs,
                  temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                  skip_special_tokens=body.skip_special_tokens,
                  presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                  repetition_penalty=body.repetition_penalty, ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
                  stop_token_ids=body.stop_token_ids, output_kind="delta")
    try:
        return SamplingParams(**{k: v for k, v in values.items() if v is not None or k == "max_tokens"})
    except ValueError as exc:
        message = str(exc)
        param = None
        if message.startswith("SamplingParams."):  # "SamplingParams.<field>=<value>: <reason>"
            message = message.removeprefix("SamplingParams.")
            param = message.split("=", 1)[0]
        raise InvalidRequest(message, param=param) from None


def _completion_prompts(prompt: str | list, max_prompts: int) -> list[str | list[int]]:
    """The prompts of a completion request: one text, one token-id list (``[]`` included), or a list of them."""
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        items: list = [prompt]
    else:
        items = list(prompt)
    if len(items) > max_prompts:
        raise InvalidRequest(f"prompt: {len(items)} prompts in one request; at most {max_prompts} "
                             "(max_prompts_per_request)", param="prompt", code="too_many_prompts")
    return items


def _processed(engine: AsyncEngine, prompts: list[str | list[int]], params: SamplingParams,
               param: str) -> list[ProcessedPrompt]:
    """Each prompt through the engine's input processing (its one validation), refusals as 400s."""
    try:
        return [engine.input_processor.process(p, params) for p in prompts]
    except InvalidRequestError as exc:
        raise input_errors.request_error(exc, prompt_param=param) from None


def _chat_prompt(engine: AsyncEngine, body: ChatCompletionRequest, *, literal_content: bool) -> list[int]:
    messages, template_kwargs = tool_calls.chat_template_inputs(engine.tokenizer, body)  # tool calling hook
    return chat_prompt_ids(engine.tokenizer, messages, literal_content=literal_content, **template_kwargs)


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    if body.stream_options is not None and not body.stream:  # as OpenAI's API answers
        raise InvalidRequest("stream_options: only allowed when stream is true", param="stream_options")
    return bool(body.stream_options and body.stream_options.include_usage)


# -- running ---------------------------------------------------------------------------------------
async def start(ctx: PlatformContext, prep: PreparedRequest) -> list[RequestStream]:
    """Add one engine request per prompt (all or none). Raises 400/404/503 ``PlatformError``s."""
    n = prep.params.n
    prep.admission = ctx.limiter.admit(
        tenant_id=prep.tenant.tenant_id, requests_per_minute=prep.tenant.requests_per_minute,
        tokens_per_minute=prep.tenant.tokens_per_minute, completions=len(prep.prompts) * n,
        tokens=reserved_tokens([len(p.token_ids) for p in prep.prompts], n=n, max_tokens=prep.params.max_tokens,
                               max_model_len=ctx.max_model_len))
    ctx.metrics.adapter_requests.labels(prep.adapter_label).inc()
    tenant = prep.tenant
    share = TenantShare(tenant.tenant_name, tenant.weight)
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prep.prompts):
            ticket = await ctx.admission.acquire(tenant)
            prep.gate_wait_s = max(prep.gate_wait_s, ticket.waited_s)
            release = _releaser(ctx, tenant.tenant_id)
            try:
                streams.append(await ctx.engine.add_request(
                    f"{prep.id}-{i}", prompt, prep.params, prep.lora, tenant=share, queue_deadline=ticket.deadline,
                    retry_after_s=retry_after_s(tenant), on_done=release))
            except BaseException:
                release()
                raise
    except BaseException as exc:
        for stream in streams:
            stream.close()
        await asyncio.get_running_loop().run_in_executor(None, ctx.limiter.settle, prep.admission, 0)
        if isinstance(exc, PlatformError) and exc.status_code in (429, 503):
            ctx.metrics.tenant_refused.labels(tenant.tenant_name, str(exc.status_code)).inc()
        raise _engine_error(exc, prep, ctx) from None
    return streams


def _releaser(ctx: PlatformContext, tenant_id: int) -> Callable[[], None]:
    """Frees one admission slot of the tenant, once however often it is called."""
    done = False

    def release() -> None:
        nonlocal done
        if not done:
            done = True
            ctx.admission.release(tenant_id)

    return release


def _engine_error(exc: BaseException, prep: PreparedRequest, ctx: PlatformContext) -> BaseException:
    """The tenant-facing error for an engine failure: a stable code and a short message, never
    the engine's text (server paths, internal ids); the details go to the log. An adapter the
    engine cannot read from its stored folder is marked broken (``mark_broken``); one its settings do not serve
    (``AdapterNotServedError``: its reason, which carries no label or path) is a 400 and stays as stored."""
    if isinstance(exc, InvalidRequestError):
        return input_errors.request_error(exc, prompt_param="messages" if prep.kind == "chat" else "prompt")
    if isinstance(exc, (AdapterConflictError, UnknownAdapterError)):
        logger.warning("request %s: adapter %r not accepted by the engine: %s", prep.id, prep.adapter_label, exc)
        return ServiceUnavailable(f"model {prep.model!r} is being replaced; retry", param="model",
                                  code="adapter_unavailable")
    if isinstance(exc, AdapterNotServedError) and prep.lora is not None:
        # a well-formed adapter this server's settings do not serve (e.g. stored before lora_target_modules was
        # narrowed): not broken, and a server with other settings serves it as stored
        logger.warning("request %s: adapter %r not served with these settings: %s", prep.id, prep.adapter_label, exc)
        return InvalidRequest(f"model {prep.model!r} cannot be served with this server's settings: {exc.reason}",
                              param="model", code="adapter_not_served")
    if isinstance(exc, AdapterError) and prep.lora is not None:
        _mark_broken_later(ctx, prep, str(exc))
        return AdapterBroken(prep.model)
    if isinstance(exc, EngineStoppedError):
        logger.error("request %s: %s", prep.id, exc)
        return ServiceUnavailable("the engine is not running")
    if isinstance(exc, PlatformError | asyncio.CancelledError):
        return exc
    reference = uuid.uuid4().hex[:12]
    logger.error("request %s failed (reference %s)", prep.id, reference, exc_info=exc)
    return InternalError(reference)


def _mark_broken_later(ctx: PlatformContext, prep: PreparedRequest, detail: str) -> None:
    """``mark_broken`` on a worker thread (a database write; the event loop must not wait for it)."""
    lora = prep.lora

    def mark() -> None:
        try:
            mark_broken(ctx, tenant_id=prep.tenant.tenant_id, name=prep.model, lora_int_id=lora.lora_int_id,
                        detail=detail)
        except Exception:  # noqa: BLE001 - the request has failed anyway; keep the reason in the log
            logger.exception("could not mark adapter %r as broken", prep.adapter_label)

    asyncio.get_running_loop().run_in_executor(None, mark)


def _raise_if_failed(output: RequestOutput) -> None:
    """The engine finishes a request whose adapter failed to load with ``error`` set."""
    if output.error:
        raise AdapterError(output.error)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from all streams as they come; closing aborts the unfinished."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                _raise_if_failed(output)
                yield 0, output
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                _raise_if_failed(output)
                await queue.put((i, output))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the consumer
            await queue.put((i, exc))
        else:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


@dataclass
class _Tracker:
    """Per-request accounting: choices' final outputs and what was streamed, usage, latency metrics."""

    prep: PreparedRequest
    ctx: PlatformContext
    prompt_tokens: int = 0
    finals: dict[int, CompletionOutput] = field(default_factory=dict)
    choices: dict[int, CompletionOutput] = field(default_factory=dict)  # choice index -> engine deltas joined
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # prompt index -> latest output
    progress: dict[int, ChoiceProgress] = field(default_factory=dict)  # choice index -> what was streamed
    token_counts: dict[int, int] = field(default_factory=dict)
    first_token_at: float | None = None
    last_output_at: float | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = sum(len(p.token_ids) for p in self.prep.prompts)

    def observe(self, prompt_index: int, output: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """Record an engine delta output; returns (choice index, the choice's state so far) pairs
        of the choices in it (the delta appended: nothing sent before is copied)."""
        now = time.monotonic()
        self.outputs[prompt_index] = output
        choices = []
        new_tokens = 0
        for delta in output.outputs:
            index = prompt_index * self.prep.params.n + delta.index
            completion = self.choices.get(index)
            if completion is None:
                completion = self.choices[index] = CompletionOutput(
                    delta.index, logprobs=None if delta.logprobs is None else [],
                    token_text_ends=None if delta.token_text_ends is None else [])
            completion.text += delta.text
            completion.token_ids += delta.token_ids
            if delta.logprobs is not None:
                completion.logprobs += delta.logprobs
            if delta.token_text_ends is not None:
                completion.token_text_ends += delta.token_text_ends
            completion.cumulative_logprob = delta.cumulative_logprob
            completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
            new_tokens += len(delta.token_ids)
            self.token_counts[index] = len(completion.token_ids)
            if completion.finished:
                self.finals[index] = completion
            choices.append((index, completion))
        if new_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                self.ctx.metrics.ttft.observe(now - self.prep.started)
                if output.queued_s is not None:
                    self.ctx.metrics.tenant_queueing_delay.labels(self.prep.tenant.tenant_name).observe(
                        self.prep.gate_wait_s + output.queued_s)
            elif self.last_output_at is not None:
                self.ctx.metrics.inter_token.observe((now - self.last_output_at) / new_tokens)
            self.last_output_at = now
        return choices

    @property
    def completion_tokens(self) -> int:
        return sum(self.token_counts.values())

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def account(self) -> Callable[[], None]:
        """A function charging this request's tokens (for a worker thread)."""
        prep, ctx, usage = self.prep, self.ctx, self.usage()
        ctx.metrics.prompt_tokens.inc(usage["prompt_tokens"])
        ctx.metrics.generation_tokens.inc(usage["completion_tokens"])
        ctx.metrics.request_latency.labels(prep.kind).observe(time.monotonic() - prep.started)

        def charge() -> None:
            record_usage(ctx, prep.tenant.tenant_id, usage["prompt_tokens"], usage["completion_tokens"],
                         admission=prep.admission)

        return charge


def record_usage(ctx: PlatformContext, tenant_id: int, prompt_tokens: int, completion_tokens: int, *,
                 admission: Admission | None = None) -> None:
    """Settle the request's rate-limit reservation (``admission``; without one, charge the
    tokens to the current window) and buffer one request's usage for the database."""
    if admission is not None:
        ctx.limiter.settle(admission, prompt_tokens + completion_tokens)
    else:
        ctx.limiter.charge(tenant_id=tenant_id, tokens=prompt_tokens + completion_tokens)
    ctx.usage.add(tenant_id, requests=1, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)


async def _charge_later(charge: Callable[[], None], *, wait: bool) -> None:
    future = asyncio.get_running_loop().run_in_executor(None, charge)
    if wait:
        await future


async def run_to_completion(ctx: PlatformContext, prep: PreparedRequest, streams: list[RequestStream],
                            is_disconnected: Callable[[], Awaitable[bool]]) -> Completion | ChatCompletion:
    """Collect the final outputs into one response. Raises ``ClientDisconnected`` (499) once the engine
    requests are aborted when the client goes away."""
    tracker = _Tracker(prep, ctx)
    merged = _merged(streams)
    consumer = asyncio.ensure_future(_consume(merged, tracker))
    client_left = False
    try:
        while not consumer.done():
            done, _ = await asyncio.wait({consumer}, timeout=0.5)
            if not done and await is_disconnected():
                client_left = True
                consumer.cancel()
                break
        await consumer
    except asyncio.CancelledError:
        await merged.aclose()
        await _charge_later(tracker.account(), wait=False)
        if client_left:  # our own cancellation, not the server's: an ordinary end, not an ASGI error
            raise ClientDisconnected("the client closed the connection before the response was ready; the "
                                     "request was aborted") from None
        raise
    except BaseException as exc:
        await merged.aclose()
        raise _engine_error(exc, prep, ctx) from None
    await _charge_later(tracker.account(), wait=True)
    return _response(prep, tracker)


async def _consume(merged: AsyncIterator[tuple[int, RequestOutput]], tracker: _Tracker) -> None:
    async for prompt_index, output in merged:
        tracker.observe(prompt_index, output)


def _response(prep: PreparedRequest, tracker: _Tracker) -> Completion | ChatCompletion:
    fmt = OpenAIFormatter(prep, prep.tokens)
    n = prep.params.n
    deltas = [fmt.delta(index, tracker.outputs[index // n], tracker.finals[index], ChoiceProgress(),
                        prompt_index=index // n) for index in sorted(tracker.finals)]
    response = fmt.response([d for d in deltas if d is not None], Usage(**tracker.usage()))
    if prep.tools is not None:  # tool calling hook: text -> content / tool_calls
        body = response.model_dump()
        body["choices"] = [prep.tools.final_choice(choice) for choice in body["choices"]]
        response = ChatCompletion.model_validate(body)
    return response


StreamEvent = CompletionChunk | ChatCompletionChunk | ErrorResponse


async def stream_chunks(ctx: PlatformContext, prep: PreparedRequest, streams: list[RequestStream]
                        ) -> AsyncIterator[StreamEvent]:
    """The stream's typed chunks: for chat first each choice's role chunk; then per engine step
    one chunk per choice with new text or tokens (each choice's ``finish_reason`` once); the
    usage chunk if asked for. An error after the start comes as an ``ErrorResponse`` (last).
    Closing the iterator (client gone) aborts the engine requests. The route encodes them
    as server-sent events and ends with ``[DONE]``."""
    tracker = _Tracker(prep, ctx)
    fmt = OpenAIFormatter(prep, prep.tokens)
    merged = _merged(streams)
    completed = False
    try:
        if prep.kind == "chat":
            for index in range(len(prep.prompts) * prep.params.n):
                yield fmt.role_chunk(index)
        async for prompt_index, output in merged:
            for index, completion in tracker.observe(prompt_index, output):
                progress = tracker.progress.setdefault(index, ChoiceProgress())
                delta = fmt.delta(index, output, completion, progress, prompt_index=prompt_index)
                if prep.tools is not None:  # tool calling hook: text -> content / tool_calls deltas
                    chunk = _tool_chunk(fmt, prep.tools, index, delta, completion.finished)
                    if chunk is not None:
                        yield chunk
                elif delta is not None:
                    yield fmt.chunk(delta)
        completed = True
        await _charge_later(tracker.account(), wait=True)
        if prep.include_usage:
            yield fmt.usage_chunk(Usage(**tracker.usage()))
    except PlatformError as exc:
        yield ErrorResponse.model_validate(exc.to_body())
    except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
        err = _engine_error(exc, prep, ctx)
        if not isinstance(err, PlatformError):
            logger.exception("stream %s failed", prep.id)  # details in the log, not in the response
        yield ErrorResponse.model_validate((err if isinstance(err, PlatformError) else InternalError()).to_body())
    finally:
        if not completed:
            await merged.aclose()
            await _charge_later(tracker.account(), wait=False)


def _tool_chunk(fmt: OpenAIFormatter, tools: tool_calls.ToolPlan, index: int, delta, finished: bool
                ) -> ChatCompletionChunk | None:
    """The chat chunk of a request with tools: the choice's new text goes through the tool-call
    parser (content and/or ``tool_calls`` deltas); ``finish_reason`` becomes ``tool_calls`` when
    calls were made. None when there is nothing to send yet (the formatter sends a choice's
    finish once, so the parser sees each piece of text and the end exactly once)."""
    if delta is None:
        return None
    piece = tools.delta(index, delta.text, finished)
    reason = tools.finish_reason(index, delta.finish_reason)
    if piece is None and reason is None and not delta.entries:
        return None
    chunk = fmt.chunk(delta)
    choice = chunk.choices[0]
    choice.delta = DeltaMessage(**(piece or {}))
    choice.finish_reason = reason
    return chunk
