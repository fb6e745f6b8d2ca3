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


class _Chunk(BaseModel):
    n: int


class _Chunks:
    """An async iterator of chunks 0..count-1 that records whether it was closed; ``on_chunk(i)`` runs first."""

    def __init__(self, count: int, on_chunk=lambda i: None) -> None:
        self.count, self.on_chunk, self.closed, self.i = count, on_chunk, False, 0

    def __aiter__(self):
        return self

    async def __anext__(self) -> _Chunk:
        if self.i >= self.count:
            raise StopAsyncIteration
        self.on_chunk(self.i)
        self.i += 1
        return _Chunk(n=self.i - 1)

    async def aclose(self) -> None:
        self.closed = True


async def _data(chunks, shutdown, grace_s, clock) -> list[str]:
    return [event.data async for event in _events(chunks, shutdown, grace_s, clock)]


def test_without_shutdown_every_chunk_then_done():
    chunks = _Chunks(3)
    data = asyncio.run(_data(chunks, anyio.Event(), 5.0, lambda: 0.0))
    assert data == ['{"n":0}', '{"n":1}', '{"n":2}', "[DONE]"] and chunks.closed


def test_after_shutdown_chunks_go_on_for_the_grace_then_an_error_event_ends_the_stream():
    """Shutdown set before chunk 2; the clock reads 10 s per chunk: the grace (25 s) starts at chunk 2 (t=20), chunks
    2, 3 and 4 (t=40 < 45) still go out, chunk 5 (t=50) is replaced by the error event; the rest are never read."""
    async def scenario():
        shutdown = anyio.Event()
        now = [0.0]

        def on_chunk(i):
            now[0] = 10.0 * i
            if i == 2:
                shutdown.set()

        chunks = _Chunks(100, on_chunk)
        return chunks, await _data(chunks, shutdown, 25.0, lambda: now[0])

    chunks, data = asyncio.run(scenario())
    assert data[:5] == ['{"n":0}', '{"n":1}', '{"n":2}', '{"n":3}', '{"n":4}'] and data[-1] == "[DONE]"
    assert len(data) == 7 and '"code":"server_shutting_down"' in data[5] and '"type":"server_error"' in data[5]
    assert "retry the request" in data[5]
    assert chunks.i == 6 and chunks.closed


class _Held:
    """The engine paused after ``steps`` steps until ``release()``; and the shutdown events of the streams started
    meanwhile (recorded from the completions route), so that a test knows when sse-starlette has seen the shutdown
    (its watcher polls every 0.5 s) before it lets the engine go on."""

    def __init__(self, live, monkeypatch, steps: int) -> None:
        import threading
        import types

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

        monkeypatch.setattr(engine, "step", held_step)
        monkeypatch.setattr(completions, "anyio", types.SimpleNamespace(Event=event))

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
