"""Streams at server shutdown: they drain for ``shutdown_stream_grace_s``, then end with a ``server_shutting_down``
error event (OpenAI error format) instead of a cut connection (the official ``openai`` client raises ``APIError``)."""

from __future__ import annotations

import asyncio

import anyio
import openai
import pytest
from platform_testlib import new_tenant
from pydantic import BaseModel
from sse_starlette.sse import AppStatus

from loraplex.platform.api.routes.completions import _events
from loraplex.platform.errors import ServerShuttingDown
from loraplex.platform.openai_schemas import ErrorResponse


class _Chunk(BaseModel):
    n: int


class _Stream:
    """An engine request stream: outputs come through a queue; ``fail`` queues the error (as RequestStream)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.failed: BaseException | None = None

    def fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.queue.put_nowait(exc)


async def _chunks(stream: _Stream):
    """What stream_chunks does with the stream: a chunk per output, an error ends it with its error body."""
    while True:
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            yield ErrorResponse.model_validate(item.to_body())
            return
        if item is None:
            return
        yield item


def test_without_shutdown_every_chunk_then_done():
    async def scenario():
        stream = _Stream()
        for i in range(3):
            stream.queue.put_nowait(_Chunk(n=i))
        stream.queue.put_nowait(None)
        data = [event.data async for event in _events(_chunks(stream), anyio.Event(), 0.0, [stream])]
        return stream, data

    stream, data = asyncio.run(scenario())
    assert data == ['{"n":0}', '{"n":1}', '{"n":2}', "[DONE]"] and stream.failed is None


def test_past_the_grace_a_stream_waiting_for_its_next_chunk_ends_with_the_error_event():
    """No chunk comes after the first (a queued request, a long prefill): the grace's end fails the engine stream,
    whose error event ends the SSE stream; nothing waits for a chunk."""
    async def scenario():
        stream, shutdown = _Stream(), anyio.Event()
        stream.queue.put_nowait(_Chunk(n=0))
        data = []
        async for event in _events(_chunks(stream), shutdown, 0.0, [stream]):
            data.append(event.data)
            shutdown.set()
        return stream, data

    stream, data = asyncio.run(scenario())
    assert isinstance(stream.failed, ServerShuttingDown)
    assert data[0] == '{"n":0}' and data[-1] == "[DONE]" and len(data) == 3
    assert '"code":"server_shutting_down"' in data[1] and '"type":"server_error"' in data[1]
    assert "retry the request" in data[1]


class _Held:
    """The engine paused after ``steps`` steps until ``release()``; and the shutdown events of the streams started
    meanwhile (recorded from the completions route), so that a test knows when sse-starlette has seen the shutdown
    (its watcher polls every 0.5 s) before it lets the engine go on."""

    def __init__(self, live, monkeypatch, steps: int) -> None:
        import threading

        from loraplex.platform.api.routes import completions

        self.events: list[anyio.Event] = []
        self._go = threading.Event()
        engine = live.ctx.engine.engine
        step, taken = engine.step, [0]

        def held_step():
            taken[0] += 1
            if taken[0] > steps:
                assert self._go.wait(60), "never released"
            return step()

        def event() -> anyio.Event:
            self.events.append(anyio.Event())
            return self.events[-1]

        class RecordingAnyio:  # the route's anyio, its Event recorded
            Event = staticmethod(event)

            def __getattr__(self, name):
                return getattr(anyio, name)

        monkeypatch.setattr(engine, "step", held_step)
        monkeypatch.setattr(completions, "anyio", RecordingAnyio())

    def shut_down(self) -> None:
        """Set sse-starlette's shutdown flag (what uvicorn's Ctrl-C / SIGTERM handler sets) and wait until the
        stream's shutdown event is set."""
        import time

        AppStatus.should_exit = True
        for _ in range(600):
            if self.events and self.events[-1].is_set():
                return
            time.sleep(0.05)
        raise AssertionError("sse-starlette never signalled the shutdown")

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def held(serve, monkeypatch):
    made = []

    def hold(live, steps: int = 2) -> _Held:
        made.append(_Held(live, monkeypatch, steps))
        return made[-1]

    yield hold
    AppStatus.should_exit = False
    for h in made:
        h.release()


def test_a_stream_at_shutdown_drains_within_its_grace(serve, held):
    live = serve()
    client = openai.OpenAI(api_key=new_tenant(live, "acme"), base_url=live.url + "/v1", max_retries=0)
    engine = held(live)
    stream = client.completions.create(model="tiny", prompt="Paris is", max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    engine.shut_down()  # the stream has sent 1-2 tokens; the engine waits
    engine.release()
    chunks += list(stream)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_a_stream_past_its_grace_ends_with_a_server_shutting_down_error(serve, held):
    live = serve(shutdown_stream_grace_s=0)
    client = openai.OpenAI(api_key=new_tenant(live, "acme"), base_url=live.url + "/v1", max_retries=0)
    engine = held(live)
    stream = client.completions.create(model="tiny", prompt="Paris is", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    received = [next(stream)]
    engine.shut_down()
    engine.release()
    with pytest.raises(openai.APIError, match="server is shutting down") as caught:
        for chunk in stream:
            received.append(chunk)
    assert caught.value.code == "server_shutting_down"
    assert len(received) <= 3  # the chunk(s) of the two steps before the shutdown; none after it


def test_a_stream_without_any_token_yet_ends_with_the_error_at_the_grace(serve, held):
    """The engine has not run the request at all (held before its first step): at the grace's end the stream still
    ends with the error event, not a cut connection."""
    live = serve(shutdown_stream_grace_s=0)
    client = openai.OpenAI(api_key=new_tenant(live, "acme"), base_url=live.url + "/v1", max_retries=0)
    engine = held(live, steps=0)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=50, stream=True)
    received = [next(stream)]  # the role chunk; no token yet
    assert received[0].choices[0].delta.role == "assistant"
    engine.shut_down()
    with pytest.raises(openai.APIError, match="server is shutting down") as caught:
        received += list(stream)
    assert caught.value.code == "server_shutting_down" and len(received) == 1
    engine.release()
