"""Evaluate tab: score a tenant's adapters against the base model on an uploaded JSONL
evaluation set, side by side, and list the stored results of earlier runs.

Runs go through the platform's evaluation service (``parse_eval_set`` ->
``run_evaluation``, the same as ``POST /v1/evaluations``): at most
``Settings.eval_max_concurrent_requests`` engine requests in flight, results stored
with each adapter version. The admin picks any tenant; a tenant only its own adapters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from loraplex.platform.context import PlatformContext
from loraplex.platform.errors import InvalidRequest
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import evaluation as evaluation_service
from loraplex.platform.services.evaluation import EvaluationReport
from loraplex.ui.format import error_text, format_time, ok_text
from loraplex.ui.session import ConsoleSession, acting_tenant, check
from loraplex.ui.tenants_tab import tenant_names
from loraplex.ui.wiring import SERVICE_ERRORS, on

SCORE_COLUMNS = ["model", "version", "correct", "items", "accuracy", "mean log-likelihood"]
HISTORY_COLUMNS = ["tenant", "adapter", "version", "evaluation set", "task", "items", "accuracy", "base accuracy",
                   "mean log-likelihood", "base mean log-likelihood", "run (UTC)"]
EVAL_SET_HELP = ("JSONL, one item per line, all of one kind: `{\"prompt\", \"choices\", \"answer\"}` "
                 "(multiple choice: the choice with the highest log-likelihood wins; `answer` is its index or "
                 "text) or `{\"prompt\", \"reference\"}` (greedy generation, normalized exact match). "
                 "Mean log-likelihood: of the right answer / reference, summed over its tokens (nats).")


def format_loglik(value: float) -> str:
    return f"{value:.4f}"


def format_accuracy(value: float) -> str:
    return f"{value:.3f}"


# -- callbacks -------------------------------------------------------------------------------------
def tenant_choices(ctx: PlatformContext, session: ConsoleSession | None, selected: str | None):
    """(tenant dropdown, message): every tenant for the admin, the tenant itself (fixed) otherwise."""
    session = check(ctx, session)
    if not session.is_admin:
        return gr.update(choices=[session.tenant_name], value=session.tenant_name, interactive=False), ""
    names = tenant_names(ctx, session)
    update = gr.update(choices=names, interactive=True)
    if selected and selected not in names:
        update["value"] = None
    return update, ""


def history_table(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None) -> pd.DataFrame:
    """Stored evaluations of the tenant's adapters (every version), newest first."""
    tenant = acting_tenant(ctx, session, tenant_name)
    with ctx.sessions() as db:
        rows = evaluation_service.list_evaluations(session=db, tenant_id=tenant.tenant_id)
    return pd.DataFrame([[r.tenant, r.adapter, r.version, r.eval_set_name, r.task, r.num_items,
                          format_accuracy(r.accuracy), format_accuracy(r.base_accuracy), format_loglik(r.mean_loglik),
                          format_loglik(r.base_mean_loglik), format_time(r.created_at)] for r in rows],
                        columns=HISTORY_COLUMNS)


def refresh(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
            selected: Sequence[str] | None):
    """(adapter checkboxes, stored results, message); empty while the admin has chosen no tenant."""
    if not tenant_name and check(ctx, session).is_admin:
        return gr.update(choices=[], value=[]), pd.DataFrame(columns=HISTORY_COLUMNS), "Choose a tenant."
    tenant = acting_tenant(ctx, session, tenant_name)
    with ctx.sessions() as db:
        names = [a.name for a in adapter_service.list_adapters(session=db, tenant_id=tenant.tenant_id)]
    kept = [n for n in (selected or []) if n in names]
    return gr.update(choices=names, value=kept), history_table(ctx, session, tenant_name), ""


def read_eval_file(ctx: PlatformContext, path: str | None) -> tuple[str, bytes]:
    """(file name, at most ``eval_max_file_bytes + 1`` bytes): the service refuses the rest."""
    if not path:
        raise InvalidRequest("upload an evaluation set (.jsonl)", param="file")
    with open(path, "rb") as f:
        return Path(path).name, f.read(ctx.settings.eval_max_file_bytes + 1)


def scores_table(report: EvaluationReport) -> pd.DataFrame:
    """Base model first, then each adapter: correct items, accuracy, mean log-likelihood."""
    n = len(report.eval_set.items)
    return pd.DataFrame([[m.model if m.adapter is None else m.adapter, "base" if m.version is None else m.version,
                          m.num_correct, n, format_accuracy(m.accuracy), format_loglik(m.mean_loglik)]
                         for m in report.models], columns=SCORE_COLUMNS)


def examples_table(report: EvaluationReport, count: int) -> pd.DataFrame:
    """The first ``count`` items: prompt, expected answer, then each model's output."""
    models = [m.model for m in report.models]
    rows = [[e["prompt"], e["expected"], *(e["outputs"][m] for m in models)] for e in report.examples(count)]
    return pd.DataFrame(rows, columns=["prompt", "expected", *models])


async def run(ctx: PlatformContext, session: ConsoleSession | None, tenant_name: str | None,
              adapters: Sequence[str] | None, path: str | None):
    """Run the evaluation. Returns (scores, examples, stored results, message)."""
    tenant = await asyncio.to_thread(acting_tenant, ctx, session, tenant_name)
    name, data = await asyncio.to_thread(read_eval_file, ctx, path)
    eval_set = evaluation_service.parse_eval_set(data, name=name, settings=ctx.settings)
    report = await evaluation_service.run_evaluation(ctx=ctx, tenant=tenant, adapter_names=list(adapters or []),
                                                     eval_set=eval_set)
    history = await asyncio.to_thread(history_table, ctx, session, tenant_name)
    task = eval_set.task.replace("_", " ")
    return (scores_table(report), examples_table(report, max(1, ctx.settings.eval_num_examples)), history,
            ok_text(f"evaluated {len(report.adapters)} adapter(s) and the base model on "
                    f"{len(eval_set.items)} {task} items of `{eval_set.name}`; results stored"))


# -- layout ----------------------------------------------------------------------------------------
@dataclass
class EvaluateTab:
    tab: gr.Tab
    tenant: gr.Dropdown
    message: gr.Markdown


def build(ctx: PlatformContext, state: gr.State) -> EvaluateTab:
    """The Evaluate tab's components and events."""
    with gr.Tab("Evaluate", id="evaluate", elem_id="tab-evaluate") as tab:
        with gr.Row():
            tenant = gr.Dropdown(label="Tenant", choices=[], elem_id="eval-tenant", scale=3)
            refresh_btn = gr.Button("Refresh", size="sm", scale=1)
        adapters = gr.CheckboxGroup(label="Adapters to compare with the base model", choices=[],
                                    elem_id="eval-adapters")
        eval_file = gr.File(label="Evaluation set (.jsonl)", file_count="single", type="filepath",
                            file_types=[".jsonl"], elem_id="eval-file")
        gr.Markdown(EVAL_SET_HELP)
        run_btn = gr.Button("Run evaluation", variant="primary", elem_id="eval-run")
        message = gr.Markdown(elem_id="eval-message")
        scores = gr.Dataframe(headers=SCORE_COLUMNS, interactive=False, elem_id="eval-scores",
                              label="Base model vs adapters")
        examples = gr.Dataframe(interactive=False, elem_id="eval-examples", label="Example outputs",
                                wrap=True)
        history = gr.Dataframe(headers=HISTORY_COLUMNS, interactive=False, elem_id="eval-history",
                               label="Stored results (per adapter version)")

    async def start(session, tenant_name, chosen, path):
        try:
            return await run(ctx, session, tenant_name, chosen, path)
        except SERVICE_ERRORS as exc:
            return gr.skip(), gr.skip(), gr.skip(), error_text(exc)

    opened = on(tab.select, ctx, tenant_choices, [state, tenant], [tenant, message], show_progress="hidden")
    on(opened.then, ctx, refresh, [state, tenant, adapters], [adapters, history, message])
    for event in (tenant.change, refresh_btn.click):
        on(event, ctx, refresh, [state, tenant, adapters], [adapters, history, message])
    run_btn.click(start, [state, tenant, adapters, eval_file], [scores, examples, history, message],
                  api_visibility="private")
    return EvaluateTab(tab=tab, tenant=tenant, message=message)
