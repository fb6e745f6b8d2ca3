"""Cache & engine tab (admin): adapter slots, CPU adapter cache, lookup cache, KV blocks,
prefix-cache hit rate, queues and throughput, per-tenant service (the scheduler's
tokens served, queue, virtual counter; tokens/s per tenant over time), refreshed by a
``gr.Timer``, with line plots over the last minutes.

The numbers are the platform's stats service (``services.stats.engine_stats``:
the engine's snapshot, ``EngineStats`` with ``lora`` = ``SlotPoolStats``) and
the lookup cache's counters, as ``GET /admin/stats`` returns them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import gradio as gr
import pandas as pd

from loraplex.platform.context import PlatformContext
from loraplex.platform.services.stats import AdapterLabel, adapter_labels, engine_stats
from loraplex.ui.session import ConsoleSession, require_admin
from loraplex.ui.wiring import on, with_error_message

SLOT_COLUMNS = ["slot", "adapter", "lora id", "pinned by (requests)"]
CPU_COLUMNS = ["LRU position (1 = next to evict)", "adapter"]
PLOT_COLUMNS = ["seconds", "value", "series"]
KV_SERIES = {"kv_blocks_used": "used", "kv_blocks_cached": "cached", "kv_blocks_free": "free"}
QUEUE_SERIES = {"num_running": "running", "num_waiting": "waiting"}
THROUGHPUT_SERIES = {"tokens_per_s": "tokens/s"}
TENANT_COLUMNS = ["tenant", "weight", "waiting", "running", "prompt tokens served", "output tokens served",
                  "virtual counter", "share of tokens"]
_TENANT_TOKENS = "tenant_tokens:"  # history key prefix: tokens served to a tenant (prompt + output)


class StatsHistory:
    """The last ``window_s`` seconds of engine stats, at most one sample per ``min_interval_s``
    (several browser sessions share one history). Thread-safe."""

    def __init__(self, window_s: float = 300.0, min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.min_interval_s = min_interval_s
        self.clock = clock
        self._samples: deque[tuple[float, dict]] = deque()
        self._lock = threading.Lock()

    def observe(self, stats: dict | None) -> None:
        """Record ``stats`` (an ``EngineStats`` dict) now, unless the last sample is too recent."""
        if stats is None:
            return
        now = self.clock()
        with self._lock:
            if self._samples and now - self._samples[-1][0] < self.min_interval_s:
                return
            values = {k: v for k, v in stats.items() if isinstance(v, (int, float))}
            for t in stats.get("tenants") or []:
                values[_TENANT_TOKENS + t["tenant_id"]] = t["prompt_tokens_served"] + t["output_tokens_served"]
            self._samples.append((now, values))
            while self._samples and now - self._samples[0][0] > self.window_s:
                self._samples.popleft()

    def frame(self, series: dict[str, str]) -> pd.DataFrame:
        """Long-format rows ``seconds`` (sample time minus now, <= 0), ``value``, ``series`` of the
        metrics in ``series`` (stats key -> label), oldest first."""
        now = self.clock()
        with self._lock:
            samples = list(self._samples)
        rows = [(round(t - now, 1), float(values[key]), label)
                for t, values in samples for key, label in series.items() if key in values]
        return pd.DataFrame(rows, columns=PLOT_COLUMNS)

    def tenant_rate_frame(self) -> pd.DataFrame:
        """Tokens/s served to each tenant between consecutive samples (``series``: tenant name)."""
        now = self.clock()
        with self._lock:
            samples = list(self._samples)
        rows = []
        for (t0, before), (t1, after) in zip(samples, samples[1:]):
            for key, value in after.items():
                if key.startswith(_TENANT_TOKENS) and t1 > t0:
                    rate = (value - before.get(key, 0)) / (t1 - t0)
                    rows.append((round(t1 - now, 1), float(rate), key.removeprefix(_TENANT_TOKENS)))
        return pd.DataFrame(rows, columns=PLOT_COLUMNS)

    def __len__(self) -> int:
        return len(self._samples)


def display_lora_name(lora_name: str | None, labels: dict[str, AdapterLabel]) -> str:
    """The adapter's label (``"acme/support v2"``, from ``services.stats.adapter_labels``); an engine
    name the registry does not know (deleted since) is shown as the engine has it."""
    if not lora_name:
        return ""
    label = labels.get(lora_name)
    return str(label) if label is not None else lora_name


def summary_text(stats: dict | None, cache: dict) -> str:
    """Markdown of the current numbers."""
    lookups = (f"**Lookup cache** ({cache['backend']}{'' if cache['available'] else ', unavailable'}): "
               f"{cache['hits']} hits / {cache['misses']} misses")
    if stats is None:
        return "No engine is running (admin API only).\n\n" + lookups
    lora = stats.get("lora") or {}
    lines = [
        (f"**KV cache blocks**: {stats['kv_blocks_used']} used / {stats['kv_blocks_cached']} cached / "
         f"{stats['kv_blocks_free']} free of {stats['kv_blocks_total']} ({stats['block_size']} tokens each)"),
        (f"**Prefix-cache hit rate**: {stats['prefix_hit_rate']:.1%} ({stats['prefix_hits_tokens']} of "
         f"{stats['prefix_queries_tokens']} prompt tokens)"),
        (f"**Requests**: {stats['num_running']} running, {stats['num_waiting']} waiting, "
         f"{stats['num_swapped']} swapped; {stats['num_preemptions']} preemptions"),
        (f"**Throughput**: {stats['tokens_per_s']:.1f} tokens/s; {stats['generated_tokens_total']} generated, "
         f"{stats['prompt_tokens_total']} prompt tokens in total"),
    ]
    if lora:
        lines.append(f"**Adapters**: {lora['slot_loads']} slot loads, {lora['slot_evictions']} slot evictions, "
                     f"{lora['disk_loads']} disk loads, {lora['cpu_evictions']} CPU cache evictions")
    lines.append(lookups)
    return "\n\n".join(lines)


def slot_tables(stats: dict | None, labels: dict[str, AdapterLabel]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(GPU slots, CPU cache in LRU order) tables."""
    lora = (stats or {}).get("lora") or {}
    slots = pd.DataFrame([[s["slot"], display_lora_name(s["lora_name"], labels) or "(empty)",
                           s["lora_int_id"] if s["lora_int_id"] is not None else "", s["pin_count"]]
                          for s in lora.get("slots", [])], columns=SLOT_COLUMNS)
    cpu = pd.DataFrame([[i + 1, display_lora_name(n, labels)] for i, n in enumerate(lora.get("cpu_cache_lru", []))],
                       columns=CPU_COLUMNS)
    return slots, cpu


def tenant_service_table(stats: dict | None) -> pd.DataFrame:
    """One row per tenant the scheduler has served: weight, queue, tokens served, the fair
    scheduler's virtual counter and the tenant's share of all tokens served."""
    tenants = (stats or {}).get("tenants") or []
    total = sum(t["prompt_tokens_served"] + t["output_tokens_served"] for t in tenants)
    rows = [[t["tenant_id"] or "(anonymous)", t["weight"], t["num_waiting"], t["num_running"],
             t["prompt_tokens_served"], t["output_tokens_served"], round(t["virtual_counter"], 1),
             f"{(t['prompt_tokens_served'] + t['output_tokens_served']) / total:.1%}" if total else "-"]
            for t in tenants]
    return pd.DataFrame(rows, columns=TENANT_COLUMNS)


# -- callbacks -------------------------------------------------------------------------------------
def stats_view(ctx: PlatformContext, session: ConsoleSession | None, history: StatsHistory):
    """(summary, GPU slots, CPU cache, KV plot, queue plot, throughput plot, message); records a sample."""
    require_admin(ctx, session)
    stats = engine_stats(ctx)
    history.observe(stats)
    with ctx.sessions() as db:
        labels = adapter_labels(session=db)
    slots, cpu = slot_tables(stats, labels)
    return (summary_text(stats, ctx.cache.stats()), slots, cpu, history.frame(KV_SERIES),
            history.frame(QUEUE_SERIES), history.frame(THROUGHPUT_SERIES), "")


def tenant_view(ctx: PlatformContext, session: ConsoleSession | None, history: StatsHistory):
    """(per-tenant service table, tokens/s per tenant plot, policy line); records a sample."""
    require_admin(ctx, session)
    stats = engine_stats(ctx)
    history.observe(stats)
    policy = (f"Scheduling policy: **{stats.get('scheduling_policy', 'fcfs')}** (fair = the least-served "
              "tenant's request first, weighted by tenant weight)") if stats else ""
    return tenant_service_table(stats), history.tenant_rate_frame(), policy


def tenant_tick(ctx: PlatformContext, session: ConsoleSession | None, history: StatsHistory):
    if session is None or not session.is_admin:
        return tuple(gr.skip() for _ in range(3))
    return tenant_view(ctx, session, history)


def tick(ctx: PlatformContext, session: ConsoleSession | None, history: StatsHistory):
    """The timer's refresh: :func:`stats_view` for an admin, no change otherwise."""
    if session is None or not session.is_admin:
        return tuple(gr.skip() for _ in range(7))
    return stats_view(ctx, session, history)


# -- layout ----------------------------------------------------------------------------------------
@dataclass
class StatsTab:
    tab: gr.Tab
    timer: gr.Timer


def _plot(title: str, elem_id: str) -> gr.LinePlot:
    return gr.LinePlot(x="seconds", y="value", color="series", title=title, x_title="seconds (0 = now)",
                       y_title="", y_lim=[0, None], y_axis_format="d", height=240, elem_id=elem_id)


def build(ctx: PlatformContext, state: gr.State, history: StatsHistory, refresh_s: float) -> StatsTab:
    """The Cache & engine tab; its timer starts inactive (the login activates it)."""
    with gr.Tab("Cache & engine", id="stats", visible=False, elem_id="tab-stats") as tab:
        message = gr.Markdown()
        summary = gr.Markdown(elem_id="stats-summary")
        with gr.Row():
            slots = gr.Dataframe(headers=SLOT_COLUMNS, interactive=False, label="GPU adapter slots",
                                 elem_id="stats-slots")
            cpu = gr.Dataframe(headers=CPU_COLUMNS, interactive=False, label="CPU adapter cache (LRU order)",
                               elem_id="stats-cpu")
        with gr.Row():
            kv = _plot("KV cache blocks", "plot-kv")
            queue = _plot("Requests", "plot-queue")
            tput = _plot("Throughput (tokens/s)", "plot-throughput")
        gr.Markdown("#### Service per tenant")
        policy = gr.Markdown(elem_id="stats-policy")
        with gr.Row():
            tenants = gr.Dataframe(headers=TENANT_COLUMNS, interactive=False, label="Tenants (scheduler)",
                                   elem_id="stats-tenants")
            tenant_plot = _plot("Tokens/s per tenant", "plot-tenants")
        timer = gr.Timer(refresh_s, active=False)
    outputs = [summary, slots, cpu, kv, queue, tput, message]
    tenant_outputs = [tenants, tenant_plot, policy]

    def view(ctx_: PlatformContext, session: ConsoleSession | None):
        return stats_view(ctx_, session, history)

    def on_tick(session: ConsoleSession | None):
        return with_error_message(len(outputs), tick, ctx, session, history)

    def tenants_now(ctx_: PlatformContext, session: ConsoleSession | None):
        return tenant_view(ctx_, session, history)

    def on_tenant_tick(session: ConsoleSession | None):
        return with_error_message(len(tenant_outputs), tenant_tick, ctx, session, history)

    on(tab.select, ctx, view, [state], outputs)
    on(tab.select, ctx, tenants_now, [state], tenant_outputs)
    timer.tick(on_tick, inputs=[state], outputs=outputs, api_visibility="private", show_progress="hidden")
    timer.tick(on_tenant_tick, inputs=[state], outputs=tenant_outputs, api_visibility="private",
               show_progress="hidden")
    return StatsTab(tab=tab, timer=timer)
