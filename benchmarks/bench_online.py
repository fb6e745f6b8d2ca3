"""Online serving through the REST API (issue 9, table 3).

The real app (``create_app``, as ``loraplex serve`` builds it, without the Gradio
console) serves a Llama-2-7B-shaped model with random bf16 weights under uvicorn,
in this process, on 127.0.0.1: SQLite registry in a temporary folder, in-process
cache (no Redis), no rate limits, the async engine on CUDA with LoRA on. Tenants,
their API keys and the adapters are created through the platform's services (the
code the admin API and the CLI call), so every request goes through key
authentication, adapter resolution and the engine thread.

Workload, the "chatbot" row of the scenario table (``bench_serving.py``): 128
random prompt token ids, 64 output tokens (greedy, ``ignore_eos``), 100 adapters
r=16 on all 7 projections owned by 4 tenants, Zipf(1.1) popularity over the
adapters plus 20% base-model requests. Adapters beyond the first few share their
weight file through a symlink but have their own config, so each is a separate
upload, version id and engine adapter (``bench_serving.make_adapters``).

Warm-up, not measured: one request per adapter (each is read into the engine's
host cache, ``max_cpu_loras`` >= 100, so no disk read happens while measuring:
``engine.disk_loads`` per rate in the JSON shows it), then bursts of 1 to 128
requests (Triton compilation; CUDA graphs are captured at engine start). The 64
device slots are filled and evicted on demand.

Load: open-loop Poisson arrivals at each rate, sent by worker processes (so the
client's Python does not share the server's GIL) as streaming
``POST /v1/completions`` with ``httpx``. Per rate (client-side definitions of
vLLM's ``benchmark_serving.py``):

- TTFT: from just before the request is sent to the first SSE chunk with text;
- ITL: the gaps between successive text chunks, pooled over all requests. The
  server sends one chunk per request and engine step, i.e. one token per chunk;
  ``tokens_per_chunk`` in the JSON (usage ``completion_tokens`` / text chunks)
  shows whether any chunk carried more;
- achieved req/s and output tok/s: completed requests and their tokens over the
  span from the first send to the last finish;
- errors: HTTP errors, in-band error events, a response ``model`` other than the
  one routed to, fewer than 64 tokens, timeouts.

Reported: the highest rate with TTFT p99 < 1 s, ITL p99 < 50 ms and no errors.
Rates above one whose TTFT p99 exceeds 5 s (or with > 10% errors) are skipped.

Usage: ``python benchmarks/bench_online.py [--quick] [--rates 2,4,8] [--seconds-per-rate S] [--out FILE]``.
``--quick`` runs the same path on CPU with a tiny random Llama (numbers meaningless).
Writes ``$OUT/online.json`` (``./online.json`` when OUT is unset); prints the markdown table last.

This module is also imported by the load-generator processes: its top level imports
only the standard library and httpx; torch and loraplex are imported by the server side.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import math
import multiprocessing
import os
import random
import secrets
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

BENCH_DIR = Path(__file__).resolve().parent
TTFT_SLO_MS = 1000.0
ITL_SLO_MS = 50.0
SERVER_THREADS = ("loraplex-engine", "uvicorn")
"""The server's threads that ``--sample-stacks`` prints: the engine loop and uvicorn's event loop."""
BASE_FRACTION = 0.2
SATURATED_TTFT_P99_MS = 5000.0
SATURATED_ERROR_FRACTION = 0.1
SEND_LEAD_S = 1.0
"""The parent fixes each rate's start this far ahead, so that every worker has its share by then."""


@dataclass(frozen=True)
class Profile:
    """One benchmark configuration (``FULL`` on an H200, ``QUICK`` on CPU).

    ``model``: overrides of ``common.LLAMA2_7B``; requests per rate:
    ``max(min_requests_per_rate, round(rate * seconds_per_rate))``; ``warmup_bursts``:
    sizes of the all-at-once bursts sent before measuring; ``drain_timeout_s``: how long
    after a rate's last arrival its requests may still run before counting as timeouts;
    ``warmup_timeout_s``: the same for a warm-up burst (the first one waits for every
    adapter's disk read, ~0.35 s each at 7B).
    """

    name: str
    model: dict
    device: str
    dtype: str
    rates_per_s: tuple[float, ...]
    seconds_per_rate: float
    min_requests_per_rate: int
    prompt_tokens: int
    output_tokens: int
    num_adapters: int
    distinct_adapter_files: int
    num_tenants: int
    lora_rank: int
    max_loras: int
    max_cpu_loras: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    gpu_memory_utilization: float
    warmup_bursts: tuple[int, ...]
    drain_timeout_s: float
    warmup_timeout_s: float
    client_processes: int
    upload_threads: int
    async_scheduling: bool = False  # the engine default; --async-scheduling turns it on
    emulate_gpu_ms: float | None = None  # CPU only: decode steps replay no-op graphs that sleep this long
    engine_process: bool = True  # the engine in a child process, as `serve` by default; --no-engine-process: a thread


FULL = Profile(
    name="full", model={}, device="cuda", dtype="bfloat16", rates_per_s=(2, 4, 8, 16, 32, 64, 96, 128),
    seconds_per_rate=10.0, min_requests_per_rate=40, prompt_tokens=128, output_tokens=64, num_adapters=100,
    distinct_adapter_files=8, num_tenants=4, lora_rank=16, max_loras=64, max_cpu_loras=128, max_num_seqs=256,
    max_num_batched_tokens=8192, max_model_len=1024, gpu_memory_utilization=0.85, warmup_bursts=(1, 8, 32, 128),
    drain_timeout_s=30.0, warmup_timeout_s=240.0, client_processes=4, upload_threads=8)
QUICK = Profile(
    name="quick", model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             torch_dtype="float32"),
    device="cpu", dtype="float32", rates_per_s=(1, 2, 4), seconds_per_rate=2.0, min_requests_per_rate=6,
    prompt_tokens=32, output_tokens=16, num_adapters=12, distinct_adapter_files=3, num_tenants=3, lora_rank=16,
    max_loras=4, max_cpu_loras=16, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256,
    gpu_memory_utilization=0.9, warmup_bursts=(1, 4), drain_timeout_s=60.0, warmup_timeout_s=120.0,
    client_processes=2, upload_threads=2)


# -- the workload (plain data, sent to the load-generator processes) ----------------------------------
@dataclass(frozen=True)
class Target:
    """Where a request goes: ``model`` as sent (and echoed in the response), the tenant's
    ``api_key``, and ``label``, the server's routing label (``loraplex_adapter_requests``):
    ``tenant/adapter``, or the base model's id."""

    model: str
    api_key: str
    label: str


@dataclass(frozen=True)
class RequestSpec:
    """One request: its target, prompt token ids, and its send time in seconds after the rate's start."""

    target: Target
    prompt: tuple[int, ...]
    send_at_s: float


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds (``time.monotonic``)."""

    target: Target
    sent_at: float
    send_lag_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text_chunks: int = 0
    completion_tokens: int = 0
    finished_at: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def poisson_offsets_s(rng: random.Random, rate_per_s: float, count: int) -> list[float]:
    """Send times (s) of ``count`` arrivals of a Poisson process: the first at 0, then
    exponential gaps of mean ``1 / rate_per_s``. Raises ``ValueError`` for a rate <= 0."""
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s={rate_per_s!r}: must be > 0")
    offsets, t = [], 0.0
    for _ in range(count):
        offsets.append(t)
        t += rng.expovariate(rate_per_s)
    return offsets


def pick_targets(rng: random.Random, adapters: list[Target], base: list[Target], count: int,
                 base_fraction: float = BASE_FRACTION) -> list[Target]:
    """The scenario table's mix: Zipf(1.1) over ``adapters`` (most popular first), each pick
    replaced by a base-model request (a random tenant's key) with probability ``base_fraction``."""
    from bench_serving import zipf_choices

    picks = zipf_choices(rng, len(adapters), count)
    return [rng.choice(base) if rng.random() < base_fraction else adapters[k] for k in picks]


def make_specs(rng: random.Random, targets: list[Target], offsets_s: list[float], prompt_tokens: int,
               vocab_size: int) -> list[RequestSpec]:
    """Requests with random prompts of ``prompt_tokens`` ids (ids 10 .. vocab_size - 10, no specials)."""
    return [RequestSpec(t, tuple(rng.randrange(10, vocab_size - 10) for _ in range(prompt_tokens)), at)
            for t, at in zip(targets, offsets_s, strict=True)]


def requests_per_rate(profile: Profile, rate_per_s: float) -> int:
    return max(profile.min_requests_per_rate, round(rate_per_s * profile.seconds_per_rate))


# -- load generator (runs in worker processes) ---------------------------------------------------------
class _StreamRecorder:
    """Reads one response's SSE events into its :class:`RequestResult`."""

    def __init__(self, result: RequestResult) -> None:
        self.result = result
        self.last_text_at: float | None = None

    def event(self, data: str, now: float) -> bool:
        """Handle one ``data:`` payload received at ``now``; False once the stream is done."""
        if data == "[DONE]":
            return False
        event = json.loads(data)
        if "error" in event:
            self.fail(f"error event: {event['error'].get('message', event['error'])}")
            return False
        if event.get("model") != self.result.target.model:
            self.fail(f"response model {event.get('model')!r}, expected {self.result.target.model!r}")
        if event.get("usage"):
            self.result.completion_tokens = event["usage"]["completion_tokens"]
        if any(choice.get("text") for choice in event.get("choices", ())):
            self._text_chunk(now)
        return True

    def _text_chunk(self, now: float) -> None:
        result = self.result
        if self.last_text_at is None:
            result.ttft_s = now - result.sent_at
        else:
            result.itl_s.append(now - self.last_text_at)
        self.last_text_at = now
        result.text_chunks += 1

    def fail(self, message: str) -> None:
        if self.result.error is None:
            self.result.error = message


def request_body(spec: RequestSpec, output_tokens: int) -> dict[str, Any]:
    """The ``/v1/completions`` body: token-id prompt, greedy, exactly ``output_tokens`` tokens, streamed."""
    return {"model": spec.target.model, "prompt": list(spec.prompt), "max_tokens": output_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _stream_one(client: httpx.AsyncClient, spec: RequestSpec, output_tokens: int,
                      result: RequestResult) -> None:
    recorder = _StreamRecorder(result)
    headers = {"Authorization": f"Bearer {spec.target.api_key}"}
    async with client.stream("POST", "/v1/completions", json=request_body(spec, output_tokens),
                             headers=headers) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            recorder.fail(f"HTTP {response.status_code}: {body[:200]}")
            return
        async for line in response.aiter_lines():
            if line.startswith("data: ") and not recorder.event(line[6:], time.monotonic()):
                break
    result.finished_at = time.monotonic()
    if result.completion_tokens != output_tokens:
        recorder.fail(f"{result.completion_tokens} completion tokens, expected {output_tokens}")


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, output_tokens: int, start: float,
                       deadline: float) -> RequestResult:
    """Wait for the request's send time, stream it, and time it; never raises."""
    await asyncio.sleep(max(0.0, start + spec.send_at_s - time.monotonic()))
    sent_at = time.monotonic()
    result = RequestResult(spec.target, sent_at, sent_at - (start + spec.send_at_s))
    try:
        await asyncio.wait_for(_stream_one(client, spec, output_tokens, result), max(0.1, deadline - sent_at))
    except TimeoutError:
        result.error = result.error or "timeout"
    except (httpx.HTTPError, OSError, ValueError) as exc:
        result.error = result.error or f"{type(exc).__name__}: {exc}"
    return result


async def _run_share(base_url: str, specs: list[RequestSpec], output_tokens: int, start: float,
                     deadline: float) -> list[RequestResult]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(None, connect=30.0)) as client:
        return list(await asyncio.gather(*(send_request(client, s, output_tokens, start, deadline) for s in specs)))


def run_share(base_url: str, specs: list[RequestSpec], output_tokens: int, start: float,
              deadline: float) -> list[RequestResult]:
    """A worker's share of one rate: send ``specs`` at ``start + send_at_s`` (``time.monotonic``,
    the same clock in every process of the host); requests unfinished at ``deadline`` time out."""
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_run_share(base_url, specs, output_tokens, start, deadline))


def _loop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_specs(pool: concurrent.futures.Executor, workers: int, base_url: str, specs: list[RequestSpec],
              output_tokens: int, drain_timeout_s: float) -> list[RequestResult]:
    """Send ``specs`` open-loop, split round-robin over ``workers`` processes of ``pool``."""
    start = time.monotonic() + SEND_LEAD_S
    deadline = start + max(s.send_at_s for s in specs) + drain_timeout_s
    futures = [pool.submit(run_share, base_url, specs[k::workers], output_tokens, start, deadline)
               for k in range(workers) if specs[k::workers]]
    return [result for future in futures for result in future.result()]


# -- statistics ----------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between order statistics
    (numpy's default method); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize_rate(rate_per_s: float, results: list[RequestResult]) -> dict[str, Any]:
    """One table row (times in ms) from the requests of one rate."""
    done = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    span_s = (max(r.finished_at for r in done) - min(r.sent_at for r in results)) if done else math.nan
    ttft_ms = [1e3 * r.ttft_s for r in done]
    itl_ms = [1e3 * gap for r in done for gap in r.itl_s]
    tokens = sum(r.completion_tokens for r in done)
    chunks = sum(r.text_chunks for r in done)
    return {
        "rate_per_s": rate_per_s, "requests": len(results), "completed": len(done), "errors": len(errors),
        "error_examples": sorted(set(errors))[:5], "span_s": span_s,
        "achieved_requests_per_s": len(done) / span_s if done else 0.0,
        "output_tokens_per_s": tokens / span_s if done else 0.0,
        "ttft_ms": _stats(ttft_ms), "itl_ms": _stats(itl_ms),
        "tokens_per_chunk": tokens / chunks if chunks else math.nan,
        "max_send_lag_ms": 1e3 * max(r.send_lag_s for r in results),
        "requests_by_target": _count_targets(results),
    }


def _stats(values_ms: list[float]) -> dict[str, float]:
    mean = sum(values_ms) / len(values_ms) if values_ms else math.nan
    return {"p50": percentile(values_ms, 50), "p99": percentile(values_ms, 99), "mean": mean, "count": len(values_ms)}


def _count_targets(results: list[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.target.label] = counts.get(r.target.label, 0) + 1
    return counts


def meets_slo(row: dict[str, Any]) -> bool:
    """TTFT p99 < 1 s, ITL p99 < 50 ms, every request completed."""
    return (row["errors"] == 0 and row["completed"] > 0 and row["ttft_ms"]["p99"] < TTFT_SLO_MS
            and row["itl_ms"]["p99"] < ITL_SLO_MS)


def highest_passing_rate(rows: list[dict[str, Any]]) -> float | None:
    """The highest offered rate whose row meets the SLO, or None."""
    passing = [row["rate_per_s"] for row in rows if meets_slo(row)]
    return max(passing) if passing else None


def saturated(row: dict[str, Any]) -> bool:
    """True when higher rates are pointless: TTFT p99 > 5 s or more than 10% errors."""
    if row["errors"] > SATURATED_ERROR_FRACTION * row["requests"]:
        return True
    return not row["ttft_ms"]["p99"] <= SATURATED_TTFT_P99_MS


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    from common import print_table

    header = ["rate req/s", "achieved req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
              "ITL p99 ms", "errors"]
    body = [[f"{r['rate_per_s']:g}", f"{r['achieved_requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.0f}",
             f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p99']:.0f}", f"{r['itl_ms']['p50']:.1f}",
             f"{r['itl_ms']['p99']:.1f}", f"{r['errors']}/{r['requests']}"] for r in rows]
    return print_table(title, header, body)


def format_cpu_table(rows: list[dict[str, Any]]) -> str:
    """Per rate, each server thread's (and the engine process's) busy share of a core and CPU us per token."""
    from common import print_table

    names = sorted({name for r in rows for name in r.get("server_cpu", {})})
    if not names:
        return ""
    header = ["rate req/s"] + [f"{name}: busy, us/token" for name in names]
    body = [[f"{r['rate_per_s']:g}"] + [
        (f"{r['server_cpu'][n]['busy']:.2f}, {r['server_cpu'][n]['us_per_token']:.0f}" if n in r.get("server_cpu", {})
         else "-") for n in names] for r in rows]
    return print_table("Server CPU per rate (thread CPU clocks; the engine process's from /proc)", header, body)


def slo_line(best: float | None, rows: list[dict[str, Any]]) -> str:
    rule = f"TTFT p99 < {TTFT_SLO_MS:.0f} ms and ITL p99 < {ITL_SLO_MS:.0f} ms (no errors)"
    if best is None:
        return f"highest rate with {rule}: none of {[r['rate_per_s'] for r in rows]} req/s"
    return f"highest rate with {rule}: {best:g} req/s"


# -- server side -----------------------------------------------------------------------------------------
@dataclass
class Served:
    """The running server: its app context, uvicorn server and thread, and base URL."""

    ctx: Any
    server: Any
    thread: threading.Thread
    base_url: str

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def model_config(profile: Profile) -> dict:
    from common import LLAMA2_7B

    return dict(LLAMA2_7B, **profile.model)


def build_engine(model_dir: Path, profile: Profile):
    """The ``LLMEngine`` (random weights) the app serves."""
    from loraplex.engine.config import EngineConfig
    from loraplex.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir), dtype=profile.dtype, device=profile.device, max_model_len=profile.max_model_len,
        gpu_memory_utilization=profile.gpu_memory_utilization, enable_lora=True, max_loras=profile.max_loras,
        max_lora_rank=profile.lora_rank, max_cpu_loras=profile.max_cpu_loras, max_num_seqs=profile.max_num_seqs,
        max_num_batched_tokens=profile.max_num_batched_tokens, async_scheduling=profile.async_scheduling)
    engine = LLMEngine(config, dummy_weights=True)
    if profile.emulate_gpu_ms is not None:
        emulate_gpu(engine, profile.emulate_gpu_ms)
    return engine


def _engine_for_settings(model_dir: Path, profile: Profile, _settings):
    """``build_engine`` as an engine factory of the engine process (picklable with ``functools.partial``)."""
    return build_engine(model_dir, profile)


def emulate_gpu(engine, step_ms: float) -> None:
    """A GPU on the CPU, for the server's host costs: decode steps take the CUDA-graph path with
    graphs whose replay sleeps ``step_ms`` (the GIL released, as a thread waiting for the device
    releases it), so the engine thread does exactly the host work of a GPU decode step and the
    model's CPU compute is gone (``bench_step_overhead.attach_graph_emulation``). Steps that carry a
    prompt chunk take the eager path, whose model forward sleeps as long and returns random states (their
    input preparation is real; their device time is not longer than a decode step's here)."""
    import torch
    from bench_step_overhead import _Graph, attach_graph_emulation

    attach_graph_emulation(engine)
    graphs = engine.runner.graphs

    class SleepingGraph:
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def replay(self) -> None:
            time.sleep(self.seconds)

    for key, graph in list(graphs.graphs.items()):
        graphs.graphs[key] = _Graph(SleepingGraph(step_ms / 1e3), graph.hidden)

    # random hidden states (as the decode graphs' outputs): the sampled tokens have text
    hidden = torch.randn(engine.config.max_num_batched_tokens, engine.spec.hidden_size,
                         generator=torch.Generator().manual_seed(0), dtype=engine.dtype)

    def forward(input_ids, *args, **kwargs):  # steps with a prompt chunk: the same sleep, no compute
        time.sleep(step_ms / 1e3)
        return hidden[: input_ids.shape[0]]

    engine.model.forward = forward


def bench_settings(data_dir: Path, model_id: str):
    """Server settings: SQLite under ``data_dir``, in-process cache, no rate limits, uploads up to 200 MB."""
    from loraplex.platform.settings import Settings

    return Settings(data_dir=data_dir, cache_dir=data_dir / "cache", database_url=None, redis_url=None,
                    admin_key=secrets.token_urlsafe(24), served_model_name=model_id, enable_lora=True,
                    max_upload_mb=200.0, default_tenant_max_upload_mb=200.0,
                    default_tenant_requests_per_minute=None, default_tenant_tokens_per_minute=None,
                    log_level="warning")


def start_server(app) -> Served:
    """uvicorn on 127.0.0.1, a free port, in a thread (no access log); returns once it listens."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                           lifespan="on", backlog=4096, timeout_keep_alive=60))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Served(app.state.ctx, server, thread, f"http://127.0.0.1:{port}")


def create_tenants(ctx, count: int, max_adapters: int) -> list[tuple[str, str]]:
    """``count`` tenants (no rate limits) with one API key each: ``[(name, key)]``."""
    from loraplex.platform.schemas import TenantCreate
    from loraplex.platform.services import tenants

    out = []
    with ctx.sessions() as session:
        for k in range(count):
            name = f"bench{k}"
            tenants.create_tenant(session=session, ctx=ctx, spec=TenantCreate(
                name=name, requests_per_minute=None, tokens_per_minute=None, max_adapters=max_adapters))
            out.append((name, tenants.create_api_key(session=session, ctx=ctx, tenant_name=name).key))
    return out


def upload(ctx, tenant_name: str, adapter_name: str, folder: Path) -> None:
    """Upload ``folder`` as the tenant's adapter through ``services.adapters.upload_adapter``
    (staging, validation against the served model, content-addressed store, registry row).
    Raises its ``PlatformError``s."""
    from loraplex.platform.demo import peft_parts
    from loraplex.platform.services import adapters, tenants

    with ctx.sessions() as session:
        owner = tenants.tenant_context(session=session, name=tenant_name)
        with peft_parts(folder) as parts:
            adapters.upload_adapter(session=session, ctx=ctx, tenant=owner, name=adapter_name, parts=parts)


def register_adapters(ctx, folders: list[Path], tenant_keys: list[tuple[str, str]], threads: int) -> list[Target]:
    """Upload adapter ``a{i}`` for tenant ``i % len(tenant_keys)``, ``threads`` at a time;
    the targets in popularity order. The engine reads each at its first request (warm-up)."""
    owners = [tenant_keys[i % len(tenant_keys)] for i in range(len(folders))]
    with concurrent.futures.ThreadPoolExecutor(threads) as uploads:
        list(uploads.map(lambda i: upload(ctx, owners[i][0], f"a{i}", folders[i]), range(len(folders))))
    return [Target(f"a{i}", key, f"{tenant}/a{i}") for i, (tenant, key) in enumerate(owners)]


def engine_counters(ctx) -> dict[str, int]:
    """Cumulative engine counters from the latest stats snapshot."""
    return counters_of(ctx.engine.stats_dict() or {})


def counters_of(stats: dict[str, Any]) -> dict[str, int]:
    """The cumulative engine counters of one stats snapshot (``stats_dict``)."""
    lora = stats.get("lora") or {}
    out = {k: stats.get(k, 0) for k in ("num_preemptions", "generated_tokens_total", "prompt_tokens_total")}
    out.update({k: lora.get(k, 0) for k in ("disk_loads", "slot_loads", "slot_evictions", "cpu_evictions")})
    return out


def settled_engine_counters(ctx, before: dict[str, int], results: list, timeout_s: float = 10.0) -> dict[str, int]:
    """``engine_counters`` once the latest snapshot shows the engine idle and at least the tokens the clients
    received since ``before`` (``results``' completion tokens), or after ``timeout_s``. A request's last output
    reaches its client before the gateway's reader thread takes the snapshot sent after it (the engine process
    sends it just behind the outputs): read at once, a burst's last tokens could be counted in the next window
    (CI: a burst of 128 read 8,137 of 8,192 tokens, the next rate 2,615 of 2,560)."""
    received = sum(r.completion_tokens for r in results if r.ok)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ctx.engine.stats_dict() or {}
        counters = counters_of(stats)
        idle = stats.get("num_running", 0) + stats.get("num_waiting", 0) == 0
        if (idle and counters["generated_tokens_total"] - before.get("generated_tokens_total", 0) >= received) \
                or time.monotonic() >= deadline:
            return counters
        time.sleep(0.01)


def counter_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def routed_counts(ctx) -> dict[str, int]:
    """Requests the server routed, by label (its ``loraplex_adapter_requests`` counter)."""
    return {sample.labels["adapter"]: int(sample.value) for metric in ctx.metrics.adapter_requests.collect()
            for sample in metric.samples if sample.name.endswith("_total")}


def routing_check(rows: list[dict[str, Any]], routed: dict[str, int]) -> dict[str, Any]:
    """Requests sent per label (all ``rows``) against the server's routed counts: labels that differ."""
    sent: dict[str, int] = {}
    for row in rows:
        for label, count in row["requests_by_target"].items():
            sent[label] = sent.get(label, 0) + count
    mismatches = {label: {"sent": sent.get(label, 0), "routed": routed.get(label, 0)}
                  for label in sorted(sent.keys() | routed.keys()) if sent.get(label, 0) != routed.get(label, 0)}
    return {"labels": len(sent), "requests": sum(sent.values()), "mismatches": mismatches}


# -- the run ---------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """Targets of the run and the random source of prompts and arrivals."""

    adapters: list[Target]
    base: list[Target]
    rng: random.Random
    vocab_size: int


def workload_specs(w: Workload, profile: Profile, count: int, offsets_s: list[float]) -> list[RequestSpec]:
    targets = pick_targets(w.rng, w.adapters, w.base, count)
    return make_specs(w.rng, targets, offsets_s, profile.prompt_tokens, w.vocab_size)


def warmup_bursts(w: Workload, profile: Profile) -> list[list[RequestSpec]]:
    """First one request per adapter and per tenant on the base model (every adapter is read into
    the engine's host cache), then Zipf-mixed bursts of ``profile.warmup_bursts`` sizes."""
    every = w.adapters + w.base
    first = make_specs(w.rng, every, [0.0] * len(every), profile.prompt_tokens, w.vocab_size)
    return [first] + [workload_specs(w, profile, size, [0.0] * size) for size in profile.warmup_bursts]


def warm_up(pool, served: Served, w: Workload, profile: Profile) -> list[dict[str, Any]]:
    """All-at-once bursts (adapter reads, kernel compilation, slot churn) before measuring;
    raises ``RuntimeError`` if any request fails."""
    rows = []
    for specs in warmup_bursts(w, profile):
        size = len(specs)
        before = engine_counters(served.ctx)
        t0 = time.perf_counter()
        results = run_specs(pool, profile.client_processes, served.base_url, specs, profile.output_tokens,
                            profile.warmup_timeout_s)
        row = summarize_rate(math.inf, results)
        rows.append({"burst": size, "wall_s": time.perf_counter() - t0, "errors": row["error_examples"],
                     "ttft_ms_p50": row["ttft_ms"]["p50"], "itl_ms_p50": row["itl_ms"]["p50"],
                     "engine": counter_delta(settled_engine_counters(served.ctx, before, results), before),
                     "requests_by_target": row["requests_by_target"]})
        print(f"[warm-up] burst of {size}: {rows[-1]['wall_s']:.1f} s, TTFT p50 {row['ttft_ms']['p50']:.0f} ms, "
              f"ITL p50 {row['itl_ms']['p50']:.1f} ms, engine {rows[-1]['engine']}", flush=True)
        if row["errors"]:
            raise RuntimeError(f"warm-up burst of {size} failed: {row['error_examples']}")
    return rows


def measure_rates(pool, served: Served, w: Workload, profile: Profile, rates: tuple[float, ...],
                  rows: list[dict[str, Any]], skipped: list[float], sample_stacks: tuple[float, ...] = ()) -> None:
    """Append one row per rate (lowest first) to ``rows``; the rates above a saturated one go
    to ``skipped`` unmeasured. At the rates in ``sample_stacks`` the server process's threads are
    sampled while the rate runs (``stack_sampler.StackSampler``; the row's ``stack_profile``)."""
    from stack_sampler import StackSampler, format_report

    for i, rate in enumerate(rates):
        count = requests_per_rate(profile, rate)
        specs = workload_specs(w, profile, count, poisson_offsets_s(w.rng, rate, count))
        before = engine_counters(served.ctx)
        sampler = StackSampler().start() if rate in sample_stacks else None
        cpu_before = server_thread_cpu_s(served.ctx.engine)
        t0 = time.perf_counter()
        try:
            results = run_specs(pool, profile.client_processes, served.base_url, specs, profile.output_tokens,
                                profile.drain_timeout_s)
        finally:
            if sampler is not None:
                sampler.stop()
        row = summarize_rate(rate, results)
        row["server_cpu"] = cpu_shares(cpu_before, server_thread_cpu_s(served.ctx.engine), time.perf_counter() - t0,
                                       sum(r.completion_tokens for r in results if r.ok))
        if sampler is not None:
            row["stack_profile"] = sampler.report(top=25)
            print(f"[rate {rate:g}/s] server threads, sampled every {1e3 * sampler.interval_s:g} ms:\n"
                  + format_report(row["stack_profile"], SERVER_THREADS, top=20), flush=True)
        row["wall_s"] = time.perf_counter() - t0
        row["engine"] = counter_delta(settled_engine_counters(served.ctx, before, results), before)
        rows.append(row)
        print(f"[rate {rate:g}/s] "
              f"{json.dumps({k: v for k, v in row.items() if k not in ('requests_by_target', 'stack_profile')})}",
              flush=True)
        if saturated(row):
            skipped.extend(rates[i + 1:])
            return


def server_thread_cpu_s(engine=None) -> dict[str, float]:
    """CPU seconds used so far by each named server thread (the engine thread, uvicorn's event loop)
    and by the whole server process (its other threads: thread pool, adapter loaders, Ray); with the
    engine in a child process (``ProcessEngineClient``), that process's CPU as ``engine-process``."""
    cpu = {"process": time.process_time()}
    child = getattr(engine, "_process", None)
    if child is not None and child.pid is not None:
        try:
            fields = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu["engine-process"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):  # not Linux, or the process is gone
            pass
    for thread in threading.enumerate():
        if thread.name in SERVER_THREADS and thread.ident is not None:
            try:
                cpu[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # thread gone, or no per-thread clocks on this OS
                pass
    return cpu


def cpu_shares(before: dict[str, float], after: dict[str, float], wall_s: float, tokens: int) -> dict[str, Any]:
    """Per thread: share of one core it kept busy over the rate (``busy``) and CPU microseconds per
    generated token delivered (``us_per_token``). The engine thread near 1.0 busy is the host
    bottleneck; uvicorn's per-token figure is what each streamed chunk costs the event loop (it
    competes with the engine thread for the GIL)."""
    return {name: {"busy": (after[name] - before[name]) / wall_s,
                   "us_per_token": 1e6 * (after[name] - before[name]) / tokens if tokens else math.nan}
            for name in after if name in before}


def prepare_adapters(root: Path, config: dict, profile: Profile) -> list[Path]:
    from bench_serving import make_adapters

    loras = make_adapters(root, config, profile.num_adapters, profile.distinct_adapter_files)
    return [Path(lora.lora_path) for lora in loras]


def run(profile: Profile, rates: tuple[float, ...], root: Path, result: dict[str, Any],
        sample_stacks: tuple[float, ...] = ()) -> None:
    """Start the server, register tenants and adapters, warm up, measure, filling ``result``
    (the JSON) as it goes, so that a failure part-way still leaves what was measured."""
    from common import make_model_dir

    from loraplex.platform.main import create_app

    timings = result.setdefault("timings_s", {})
    config = model_config(profile)
    t0 = time.perf_counter()
    model_dir = make_model_dir(root / result["model_id"], config)
    settings = bench_settings(root / "data", result["model_id"])
    if profile.engine_process:  # the engine in a child process (ProcessEngineClient), built there
        from loraplex.platform.engine_process import ProcessEngineClient

        engine = ProcessEngineClient(settings, functools.partial(_engine_for_settings, model_dir, profile))
    else:
        engine = build_engine(model_dir, profile)
    served = start_server(create_app(settings, engine))
    timings["engine_and_server_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        folders = prepare_adapters(root / "adapters", config, profile)
        tenant_keys = create_tenants(served.ctx, profile.num_tenants, max_adapters=profile.num_adapters)
        adapters = register_adapters(served.ctx, folders, tenant_keys, profile.upload_threads)
        timings["adapters_s"] = time.perf_counter() - t0
        base = [Target(result["model_id"], key, result["model_id"]) for _, key in tenant_keys]
        w = Workload(adapters, base, random.Random(0), config["vocab_size"])
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(profile.client_processes, mp_context=spawn) as pool:
            t0 = time.perf_counter()
            result["warmup"] = warm_up(pool, served, w, profile)
            timings["warmup_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            measure_rates(pool, served, w, profile, rates, result["rates"], result["skipped_rates"], sample_stacks)
            timings["rates_s"] = time.perf_counter() - t0
        result["engine_totals"] = engine_counters(served.ctx)
        result["routing"] = routing_check(result["warmup"] + result["rates"], routed_counts(served.ctx))
    finally:
        served.stop()


def device_name(profile: Profile) -> str:
    import torch

    if profile.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_online.py needs a CUDA GPU; use --quick on a CPU machine")
        return torch.cuda.get_device_name()
    return "cpu"


def default_json_path() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "online.json" if out else Path("online.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny random Llama on CPU, tiny rates")
    ap.add_argument("--rates", type=lambda s: tuple(float(x) for x in s.split(",")), default=None,
                    help="comma-separated request rates per second (default: the profile's)")
    ap.add_argument("--seconds-per-rate", type=float, default=None, help="arrival window of each rate")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: $OUT/online.json or ./online.json)")
    ap.add_argument("--emulate-gpu-ms", type=float, default=None,
                    help="with --quick: decode steps sleep this long instead of computing (the host costs of a GPU "
                         "server at that step time; see emulate_gpu)")
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="the engine in a process of its own (the server's default); --no-engine-process: a thread "
                         "of the server process (serve --no-engine-process)")
    ap.add_argument("--output-tokens", type=int, default=None,
                    help="tokens generated per request (default: the profile's; two runs that differ only here "
                         "split a thread's CPU into per-request and per-token parts)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the engine with async_scheduling=True (default: off, the engine default)")
    ap.add_argument("--sample-stacks", type=lambda s: tuple(float(x) for x in s.split(",")), default=(),
                    help="comma-separated rates (of --rates) at which the server's Python threads are sampled "
                         "(stack_sampler.py): per thread, the functions holding its time")
    return ap.parse_args(argv)


def new_result(profile: Profile, device: str, commit: str) -> dict[str, Any]:
    model_id = "llama-2-7b-random" if profile.name == "full" else "tiny-llama-random"
    return {"commit": commit, "device": device, "model_id": model_id, "profile": dataclasses.asdict(profile),
            "slo": {"ttft_p99_ms": TTFT_SLO_MS, "itl_p99_ms": ITL_SLO_MS}, "timings_s": {}, "warmup": [],
            "rates": [], "skipped_rates": [], "best_rate_per_s": None, "routing": None, "error": None}


def report(result: dict[str, Any], profile: Profile) -> None:
    """Print the routing check, the markdown table and the SLO line (last)."""
    routing = result["routing"]
    if routing is not None:
        print(f"routing: {routing['requests']} requests over {routing['labels']} models/adapters, "
              f"{len(routing['mismatches'])} label counts differing from the server's", flush=True)
    title = (f"Online serving via REST, {profile.num_adapters} adapters r={profile.lora_rank} Zipf + 20% base, "
             f"prompt {profile.prompt_tokens} / output {profile.output_tokens}, async scheduling "
             f"{'on' if profile.async_scheduling else 'off'}"
             f"{', engine process' if profile.engine_process else ', engine thread'}"
             f"{f', GPU emulated ({profile.emulate_gpu_ms:g} ms steps)' if profile.emulate_gpu_ms else ''} "
             f"(commit {result['commit']}, {result['device']}, {result['model_id']})")
    format_cpu_table(result["rates"])
    format_table(result["rates"], title)
    skipped = f" (not run after saturation: {result['skipped_rates']})" if result["skipped_rates"] else ""
    print(slo_line(result["best_rate_per_s"], result["rates"]) + skipped, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON result. Exits with status 1 (after writing the JSON
    and printing what was measured) when the run failed part-way."""
    sys.path.insert(0, str(BENCH_DIR))
    sys.path.insert(0, str(BENCH_DIR.parent))
    from common import git_commit

    args = parse_args(argv)
    profile = QUICK if args.quick else FULL
    if args.seconds_per_rate is not None:
        profile = dataclasses.replace(profile, seconds_per_rate=args.seconds_per_rate)
    if args.async_scheduling:
        profile = dataclasses.replace(profile, async_scheduling=True)
    if args.emulate_gpu_ms is not None:
        if not args.quick:
            raise SystemExit("--emulate-gpu-ms is for --quick (CPU) runs")
        # The GPU profile's scheduling limits and workload (slots, batch, adapters, lengths), the tiny model
        profile = dataclasses.replace(FULL, name="emulated-gpu", model=QUICK.model, device="cpu", dtype="float32",
                                      emulate_gpu_ms=args.emulate_gpu_ms, client_processes=2, upload_threads=2,
                                      distinct_adapter_files=QUICK.distinct_adapter_files,
                                      seconds_per_rate=profile.seconds_per_rate, max_model_len=256)
    if args.engine_process is not None:
        profile = dataclasses.replace(profile, engine_process=args.engine_process)
    if args.output_tokens is not None:
        profile = dataclasses.replace(profile, output_tokens=args.output_tokens)
    rates = args.rates or profile.rates_per_s
    if not all(r > 0 for r in rates):
        raise SystemExit(f"--rates={rates}: every rate must be > 0")
    if not set(args.sample_stacks) <= set(rates):
        raise SystemExit(f"--sample-stacks={args.sample_stacks}: each must be one of the rates {rates}")
    result = new_result(profile, device_name(profile), os.environ.get("LORAPLEX_COMMIT") or git_commit())
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="loraplex-online-") as tmp:
            run(profile, tuple(sorted(rates)), Path(tmp), result, args.sample_stacks)
    except Exception as exc:  # noqa: BLE001 - keep what was measured
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["best_rate_per_s"] = highest_passing_rate(result["rates"])
    result["total_s"] = time.perf_counter() - t0
    path = args.out or default_json_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path} ({result['total_s']:.0f} s in all: {result['timings_s']})", flush=True)
    report(result, profile)
    if result["error"]:
        raise SystemExit(f"bench_online failed: {result['error']}")
    return result


if __name__ == "__main__":
    main()
