"""The console's callbacks return what the platform's services say (no browser).

Each test drives a callback with a real ``PlatformContext`` (SQLite registry,
in-memory store, the tiny random Llama) and compares its output with the
service functions the REST API uses, called directly.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import json
import itertools
import zipfile

import gradio as gr
import pytest
from pydantic import ValidationError
from ui_testlib import ADMIN_KEY, MODEL_ID

from loraplex.platform import crud
from loraplex.platform.errors import (
    Conflict,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PlatformError,
    Unauthenticated,
)
from loraplex.platform.models import AdapterVersion
from loraplex.platform.openai_schemas import ChatCompletionRequest
from loraplex.platform.schemas import TenantCreate
from loraplex.platform.services import adapters as adapter_service
from loraplex.platform.services import serving
from loraplex.platform.services import tenants as tenant_service
from loraplex.platform.services.stats import engine_stats
from loraplex.ui import adapters_tab, evaluate_tab, playground_tab, stats_tab, tenants_tab, usage_tab
from loraplex.ui.console import sign_in
from loraplex.ui.format import error_text
from loraplex.ui.playground_tab import SamplingSettings
from loraplex.ui.session import ConsoleSession, acting_tenant, check, login
from loraplex.ui.stats_tab import StatsHistory
from loraplex.ui.wiring import with_error_message

GREEDY = SamplingSettings(temperature=0.0, top_p=1.0, max_tokens=12)


# -- helpers ---------------------------------------------------------------------------------------
def admin() -> ConsoleSession:
    return ConsoleSession(role="admin", key=ADMIN_KEY)


def add_tenant(ctx, name: str, **limits) -> str:
    """Create a tenant through the service; returns a fresh API key of it."""
    with ctx.sessions() as db:
        tenant_service.create_tenant(session=db, ctx=ctx, spec=TenantCreate(name=name, **limits))
        return tenant_service.create_api_key(session=db, ctx=ctx, tenant_name=name).key


def upload(ctx, tenant_name: str, name: str, files: list[str]) -> None:
    adapters_tab.confirm_upload(ctx, admin(), tenant_name, name, files)


def records(frame) -> list[dict]:
    return frame.to_dict("records")


def collect(agen) -> list:
    async def run() -> list:
        return [item async for item in agen]

    return asyncio.run(run())


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buf.getvalue()


# -- sign-in ---------------------------------------------------------------------------------------
def test_login_opens_the_admin_and_tenant_views(ctx):
    key = add_tenant(ctx, "acme")
    assert login(ctx, ADMIN_KEY) == ConsoleSession(role="admin", key=ADMIN_KEY)
    tenant = login(ctx, f"  {key} ")
    assert (tenant.role, tenant.tenant_name, tenant.is_admin) == ("tenant", "acme", False)
    assert key not in repr(tenant) and ADMIN_KEY not in repr(login(ctx, ADMIN_KEY))  # keys are never printed


def test_wrong_key_shows_the_service_message(ctx):
    with pytest.raises(Unauthenticated) as refused:
        tenant_service.authenticate_tenant(ctx=ctx, token="lpx-wrong")
    outputs = with_error_message(13, sign_in, ctx, "lpx-wrong")
    assert outputs[-1] == f"**Error:** {refused.value.message}" == "**Error:** Incorrect API key provided."
    assert all(o == gr.skip() for o in outputs[:-1])  # the session state stays empty
    assert "Enter the admin key" in with_error_message(13, sign_in, ctx, "   ")[-1]


def test_sign_in_shows_the_tabs_of_the_role(ctx):
    key = add_tenant(ctx, "acme")
    session, *_, tenants_vis, stats_vis, usage_vis, tabs, timer, adapters_tenant, chat_tenant, _ = sign_in(ctx, key)
    assert session.tenant_name == "acme"
    assert (tenants_vis["visible"], stats_vis["visible"], usage_vis["visible"]) == (False, False, True)
    assert (tabs["selected"], timer.active) == ("adapters", False)
    assert adapters_tenant == gr.update(choices=["acme"], value="acme", interactive=False) == chat_tenant
    session, *_, tenants_vis, stats_vis, usage_vis, tabs, timer, adapters_tenant, _, _ = sign_in(ctx, ADMIN_KEY)
    assert session.is_admin and tenants_vis["visible"] and stats_vis["visible"] and not usage_vis["visible"]
    assert (tabs["selected"], timer.active) == ("tenants", True)
    assert adapters_tenant["choices"] == ["acme"] and adapters_tenant["value"] is None


def test_a_revoked_key_loses_the_console_at_the_next_click(ctx):
    key = add_tenant(ctx, "acme")
    session = login(ctx, key)
    tenants_tab.revoke_key(ctx, admin(), "acme", "1")
    with pytest.raises(Unauthenticated, match="Incorrect API key"):
        check(ctx, session)
    with pytest.raises(Unauthenticated, match="Not signed in"):
        check(ctx, None)


def test_a_tenant_cannot_act_for_another_tenant(ctx):
    key = add_tenant(ctx, "acme")
    add_tenant(ctx, "globex")
    session = login(ctx, key)
    assert acting_tenant(ctx, session, None).tenant_name == "acme"
    with pytest.raises(NotFound, match="'globex' does not exist"):
        adapters_tab.adapters_table(ctx, session, "globex")
    with pytest.raises(Unauthenticated, match="needs the admin key"):
        tenants_tab.tenants_table(ctx, session)
    assert acting_tenant(ctx, admin(), "globex").tenant_name == "globex"


# -- tenants and keys ------------------------------------------------------------------------------
def test_create_tenant_lists_what_the_service_stored(ctx):
    table, dropdown, message = tenants_tab.create_tenant(ctx, admin(), " acme ", "60", "", "3", "2.5")
    with ctx.sessions() as db:
        stored = tenant_service.get_tenant(session=db, name="acme")
    assert (stored.requests_per_minute, stored.tokens_per_minute, stored.max_adapters, stored.max_upload_mb) == (
        60, ctx.settings.default_tenant_tokens_per_minute, 3, 2.5)
    row = records(table)[0]
    assert (row["tenant"], row["requests/min"], row["tokens/min"], row["max adapters"], row["max upload MB"]) == (
        "acme", "60", "unlimited", 3, 2.5)
    assert dropdown == gr.update(choices=["acme"], value="acme")
    assert "acme" in message


def test_bad_tenant_input_names_the_field_and_value(ctx):
    with pytest.raises(ValidationError) as bad:
        tenants_tab.create_tenant(ctx, admin(), "no spaces", "", "", "", "")
    text = error_text(bad.value)
    assert "`name`='no spaces'" in text and "pattern" in text
    with pytest.raises(ValidationError) as bad:
        tenants_tab.create_tenant(ctx, admin(), "acme", "lots", "", "", "")
    assert "`requests_per_minute`='lots'" in error_text(bad.value)
    tenants_tab.create_tenant(ctx, admin(), "acme", "", "", "", "")
    with pytest.raises(Conflict) as taken:
        tenants_tab.create_tenant(ctx, admin(), "acme", "", "", "", "")
    assert error_text(taken.value) == "**Error:** tenant 'acme' already exists (field `name`)"


def test_edit_limits_and_load_them_back(ctx):
    add_tenant(ctx, "acme", requests_per_minute=5)
    assert tenants_tab.load_tenant(ctx, admin(), "acme")[:4] == ("5", "", "10", "50")
    table, message = tenants_tab.save_limits(ctx, admin(), "acme", "", "1000000", "4", "")
    with ctx.sessions() as db:
        stored = tenant_service.get_tenant(session=db, name="acme")
    assert (stored.requests_per_minute, stored.tokens_per_minute, stored.max_adapters, stored.max_upload_mb) == (
        None, 1_000_000, 4, 50.0)  # empty rate = unlimited, empty size = unchanged
    assert records(table)[0]["tokens/min"] == "1000000"
    assert "unlimited requests/min, 1000000 tokens/min, 4 adapters, 50 MB" in message
    with pytest.raises(InvalidRequest, match="choose a tenant"):
        tenants_tab.save_limits(ctx, admin(), None, "", "", "", "")


def test_keys_are_shown_once_and_revocable(ctx):
    add_tenant(ctx, "acme")
    new_key, keys, key_ids, table, message = tenants_tab.create_key(ctx, admin(), "acme")
    assert tenant_service.authenticate_tenant(ctx=ctx, token=new_key["value"]).tenant_name == "acme"
    assert new_key["visible"] and "not shown again" in message
    with ctx.sessions() as db:
        listed = tenant_service.list_api_keys(session=db, tenant_name="acme")
    assert [r["id"] for r in records(keys)] == [k.id for k in listed] == [1, 2]
    assert new_key["value"] not in keys.to_string()  # listings show prefixes only
    assert key_ids["choices"] == ["1", "2"] and records(table)[0]["keys"] == 2
    keys, key_ids, table, _ = tenants_tab.revoke_key(ctx, admin(), "acme", "2")
    assert key_ids["choices"] == ["1"] and records(keys)[1]["revoked (UTC)"] != ""
    with pytest.raises(Unauthenticated):
        tenant_service.authenticate_tenant(ctx=ctx, token=new_key["value"])
    with pytest.raises(NotFound, match="key 9 of tenant 'acme' does not exist"):
        tenants_tab.revoke_key(ctx, admin(), "acme", "9")


def test_disable_revokes_every_key(ctx):
    first = add_tenant(ctx, "acme")
    second = tenants_tab.create_key(ctx, admin(), "acme")[0]["value"]
    table, _keys, key_ids, message = tenants_tab.disable_tenant(ctx, admin(), "acme")
    for key in (first, second):
        with pytest.raises(Unauthenticated):
            tenant_service.authenticate_tenant(ctx=ctx, token=key)
    assert key_ids["choices"] == [] and records(table)[0]["keys"] == 0 and "2 key(s) revoked" in message


def test_delete_tenant_after_confirmation(ctx):
    add_tenant(ctx, "acme")
    row, question, _ = tenants_tab.ask_delete(ctx, admin(), "acme")
    assert row["visible"] and "acme" in question
    table, dropdown, row, _message = tenants_tab.delete_tenant(ctx, admin(), "acme")
    with ctx.sessions() as db:
        assert tenant_service.list_tenants(session=db) == []
    assert table.empty and dropdown["choices"] == [] and not row["visible"]


def test_usage_columns_count_the_last_24_hours_and_all_time(ctx):
    add_tenant(ctx, "acme")
    add_tenant(ctx, "globex")
    now = dt.datetime(2025, 3, 10, 9, 0, tzinfo=dt.UTC)
    with ctx.sessions() as db:
        tenant_id = tenant_service.tenant_context(session=db, name="acme").tenant_id
        for day, prompt, completion in ((dt.date(2025, 3, 10), 10, 5), (dt.date(2025, 3, 9), 7, 3),
                                        (dt.date(2025, 3, 1), 100, 100)):
            crud.record_usage(session=db, tenant_id=tenant_id, requests=1, prompt_tokens=prompt,
                              completion_tokens=completion, day=day)
        db.commit()
        totals = {name: (r, p + c) for name, r, p, c in crud.usage_by_tenant(session=db)}
    rows = {r["tenant"]: r for r in records(tenants_tab.tenants_table(ctx, admin(), now=now))}
    assert (rows["acme"]["requests (24 h)"], rows["acme"]["tokens (24 h)"]) == (2, 25)
    assert (rows["acme"]["requests (total)"], rows["acme"]["tokens (total)"]) == totals["acme"] == (3, 225)
    assert (rows["globex"]["requests (24 h)"], rows["globex"]["tokens (total)"]) == (0, 0)


def test_tenant_usage_view(ctx):
    key = add_tenant(ctx, "acme", tokens_per_minute=500)
    serving.record_usage(ctx, acting_tenant(ctx, admin(), "acme").tenant_id, 11, 4)
    assert ctx.usage.flush()  # usage is written by a background writer
    limits, table, _ = usage_tab.own_usage(ctx, login(ctx, key))
    assert records(table) == [
        {"period": "last 24 h", "requests": 1, "prompt tokens": 11, "completion tokens": 4, "total tokens": 15},
        {"period": "all time", "requests": 1, "prompt tokens": 11, "completion tokens": 4, "total tokens": 15}]
    assert "500 tokens/min" in limits and "0 of 10 adapters" in limits
    with pytest.raises(Unauthenticated):
        usage_tab.own_usage(ctx, admin())


# -- adapters --------------------------------------------------------------------------------------
def test_check_validates_without_storing(ctx, peft_files):
    add_tenant(ctx, "acme")
    button, report = adapters_tab.check_upload(ctx, admin(), "acme", "shouty", peft_files)
    assert button == gr.update(interactive=True)
    assert "rank **8** (server max 8), alpha 16" in report
    assert "targets: q_proj, v_proj, o_proj in 2 layer(s)" in report and "base model `tiny`" in report
    assert "new adapter" in report
    with ctx.sessions() as db:
        assert db.query(AdapterVersion).count() == 0
    assert not ctx.settings.adapters_dir.exists() or list(ctx.settings.adapters_dir.iterdir()) == []
    assert list(ctx.settings.uploads_tmp_dir.iterdir()) == []


def test_confirm_stores_what_the_service_lists(ctx, peft_files):
    add_tenant(ctx, "acme")
    table, names, button, message = adapters_tab.confirm_upload(ctx, admin(), "acme", "shouty", peft_files)
    with ctx.sessions() as db:
        listed = adapter_service.list_adapters(session=db, tenant_id=acting_tenant(ctx, admin(), "acme").tenant_id)
    [a] = listed
    assert records(table) == [{
        "adapter": "shouty", "version": a.version, "type": "lora", "rank": 8, "alpha": 16.0,
        "target modules": ", ".join(a.target_modules), "modules_to_save": "",
        "size": adapters_tab.format_bytes(a.size_bytes), "status": "stored", "uploaded (UTC)": adapters_tab.format_time(a.created_at),
        "version id": a.version_id[:12]}]
    assert names["choices"] == ["shouty"] and button == gr.update(interactive=False)
    assert "version 1 stored" in message and "no engine is running" in message
    assert "replaces live version 1" in adapters_tab.check_upload(ctx, admin(), "acme", "shouty", peft_files)[1]


def test_dora_upload_is_reported_and_listed_as_dora(ctx, tiny_llama_dir, tmp_path):
    from tiny_models import make_peft_adapter
    from ui_testlib import PEFT_FILES

    folder = make_peft_adapter(tiny_llama_dir, tmp_path / "dora", r=4, alpha=8, targets=("q_proj", "o_proj"),
                               use_dora=True, seed=4)
    files = [str(folder / name) for name in PEFT_FILES]
    add_tenant(ctx, "acme")
    assert "valid PEFT DoRA adapter" in adapters_tab.check_upload(ctx, admin(), "acme", "mag", files)[1]
    table, *_ = adapters_tab.confirm_upload(ctx, admin(), "acme", "mag", files)
    assert [(row["adapter"], row["type"]) for row in records(table)] == [("mag", "dora")]


def test_confirm_reports_progress(ctx, peft_files):
    add_tenant(ctx, "acme")
    steps = []
    adapters_tab.confirm_upload(ctx, admin(), "acme", "shouty", peft_files,
                                progress=lambda fraction, desc=None: steps.append((fraction, desc)))
    assert [f for f, _ in steps] == sorted(f for f, _ in steps) and steps[-1] == (1.0, "done")


@pytest.mark.parametrize("members, expected", [
    (None, "neither a .zip nor a .tar.gz"),
    ({"adapter_config.json": b"{}"}, "archive lacks ['adapter_model.safetensors']"),
    ({"adapter_config.json": b"{not json", "adapter_model.safetensors": b"x"}, "adapter_config.json"),
])
def test_bad_archives_show_the_service_refusal(ctx, tmp_path, members, expected):
    add_tenant(ctx, "acme")
    archive = tmp_path / "upload.zip"
    archive.write_bytes(b"not an archive at all" if members is None else zip_bytes(members))
    tenant = acting_tenant(ctx, admin(), "acme")
    with adapters_tab.open_parts([str(archive)]) as parts, ctx.sessions() as db, \
            pytest.raises(PlatformError) as direct:
        adapter_service.upload_adapter(session=db, ctx=ctx, tenant=tenant, name="bad", parts=parts)
    assert expected in direct.value.message
    for callback in (adapters_tab.check_upload, adapters_tab.confirm_upload):
        with pytest.raises(PlatformError) as shown:
            callback(ctx, admin(), "acme", "bad", [str(archive)])
        assert error_text(shown.value) == error_text(direct.value)


def test_incompatible_adapter_is_refused_with_the_reason(ctx, tiny_llama_dir, tmp_path):
    from tiny_models import make_peft_adapter

    add_tenant(ctx, "acme")
    too_big = make_peft_adapter(tiny_llama_dir, tmp_path / "r16", r=16, alpha=16)
    files = [str(too_big / n) for n in ("adapter_config.json", "adapter_model.safetensors")]
    with pytest.raises(InvalidRequest) as refused:
        adapters_tab.check_upload(ctx, admin(), "acme", "big", files)
    assert refused.value.code == "invalid_adapter"
    assert "16" in refused.value.message and "max_lora_rank=8" in refused.value.message


def test_missing_files_and_names(ctx, peft_files):
    add_tenant(ctx, "acme")
    with pytest.raises(InvalidRequest, match="choose one archive"):
        adapters_tab.check_upload(ctx, admin(), "acme", "x", None)
    with pytest.raises(InvalidRequest, match="name='bad name'"):
        adapters_tab.check_upload(ctx, admin(), "acme", "bad name", peft_files)
    with pytest.raises(InvalidRequest, match="base model's id"):
        adapters_tab.check_upload(ctx, admin(), "acme", MODEL_ID, peft_files)


def test_delete_adapter_after_confirmation(ctx, peft_files):
    add_tenant(ctx, "acme")
    upload(ctx, "acme", "shouty", peft_files)
    with pytest.raises(InvalidRequest, match="choose the adapter"):
        adapters_tab.ask_delete(ctx, admin(), "acme", None)
    assert adapters_tab.ask_delete(ctx, admin(), "acme", "shouty")[0]["visible"]
    table, names, row, _message = adapters_tab.delete_adapter(ctx, admin(), "acme", "shouty")
    assert table.empty and names["choices"] == [] and not row["visible"]
    with pytest.raises(NotFound):
        adapters_tab.delete_adapter(ctx, admin(), "acme", "shouty")


def test_residency_reads_the_slot_pool_stats():
    stats = {"slots": [{"slot": 0, "lora_int_id": 7, "pin_count": 0}, {"slot": 1, "lora_int_id": 9, "pin_count": 2}],
             "cpu_cache_lru": ["1/a@1", "1/b@3"]}
    assert adapters_tab.residency(7, "1/x@1", stats) == "in GPU slot 0"
    assert adapters_tab.residency(9, "1/y@1", stats) == "in GPU slot 1 (pinned by 2 running)"
    assert adapters_tab.residency(3, "1/b@3", stats) == "in CPU cache"
    assert adapters_tab.residency(4, "1/c@1", stats) == "stored" == adapters_tab.residency(4, "1/c@1", None)


# -- engine: preload, chat, stats ------------------------------------------------------------------
def test_upload_loads_into_the_cpu_cache_then_a_chat_into_a_gpu_slot(running_ctx, peft_files):
    ctx = running_ctx
    add_tenant(ctx, "acme")
    table, _, _, message = adapters_tab.confirm_upload(ctx, admin(), "acme", "shouty", peft_files)
    assert records(table)[0]["status"] == "in CPU cache" and "loaded into the engine's CPU cache" in message
    route = adapter_service.resolve_adapter(ctx=ctx, tenant_id=acting_tenant(ctx, admin(), "acme").tenant_id,
                                            name="shouty")
    assert engine_stats(ctx)["lora"]["cpu_cache_lru"] == [route.lora_name]

    collect(playground_tab.chat(ctx, admin(), "acme", "shouty", "hi", [], GREEDY))
    assert records(adapters_tab.adapters_table(ctx, admin(), "acme"))[0]["status"] == "in GPU slot 0"

    history = StatsHistory()
    summary, slots, cpu, kv, _queue, _tput, _ = stats_tab.stats_view(ctx, admin(), history)
    stats = engine_stats(ctx)
    assert records(slots)[0] == {"slot": 0, "adapter": "acme/shouty v1", "lora id": route.lora_int_id,
                                 "pinned by (requests)": 0}
    assert records(slots)[1]["adapter"] == "(empty)"
    assert records(cpu) == [{"LRU position (1 = next to evict)": 1, "adapter": "acme/shouty v1"}]
    assert f"{stats['generated_tokens_total']} generated" in summary and stats["generated_tokens_total"] > 0
    assert f"{stats['kv_blocks_cached']} cached" in summary
    assert set(kv["series"]) == {"used", "cached", "free"} and len(history) == 1
    assert "hits" in summary and "MemoryStore" in summary


def _api_reply(ctx, tenant_name: str, model: str, message: str, settings: SamplingSettings) -> str:
    """The same request through the serving service, not streamed (as the REST API answers it)."""
    tenant = acting_tenant(ctx, admin(), tenant_name)
    body = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": message}], stream=False,
                                 temperature=settings.temperature, top_p=settings.top_p,
                                 max_tokens=settings.max_tokens, seed=settings.seed)

    async def run():
        prep = serving.prepare_chat(ctx=ctx, tenant=tenant, body=body)
        streams = await serving.start(ctx, prep)

        async def connected() -> bool:
            return False

        return await serving.run_to_completion(ctx, prep, streams, connected)

    return asyncio.run(run()).choices[0].message.content


def test_chat_streams_the_reply_the_api_gives(running_ctx, peft_files):
    ctx = running_ctx
    add_tenant(ctx, "acme")
    upload(ctx, "acme", "shouty", peft_files)
    updates = collect(playground_tab.chat(ctx, admin(), "acme", "shouty", " Hello there ", [], GREEDY))
    replies = [history[-1]["content"] for history, _ in updates]
    assert replies[0] == "" and len(set(replies)) > 3  # streamed: the reply grows step by step
    assert all(b.startswith(a) for a, b in itertools.pairwise(replies))
    assert replies[-1] == _api_reply(ctx, "acme", "shouty", "Hello there", GREEDY)
    assert updates[-1][0][-2] == {"role": "user", "content": "Hello there"}
    base = collect(playground_tab.chat(ctx, admin(), "acme", MODEL_ID, "Hello there", [], GREEDY))[-1][0][-1]
    assert base["content"] == _api_reply(ctx, "acme", MODEL_ID, "Hello there", GREEDY) != replies[-1]
    assert ctx.usage.flush()  # usage is written by a background writer
    with ctx.sessions() as db:  # the playground's requests are charged to the tenant
        assert crud.usage_by_tenant(session=db)[0][1] == 4


def test_side_by_side_sends_the_message_to_both(running_ctx, peft_files):
    ctx = running_ctx
    add_tenant(ctx, "acme")
    upload(ctx, "acme", "shouty", peft_files)
    updates = collect(playground_tab.chat_side_by_side(ctx, admin(), "acme", "shouty", "Paris is", [], [], GREEDY))
    base, adapter, status = updates[-1]
    assert base[-1]["content"] == _api_reply(ctx, "acme", MODEL_ID, "Paris is", GREEDY)
    assert adapter[-1]["content"] == _api_reply(ctx, "acme", "shouty", "Paris is", GREEDY)
    assert base[-1]["content"] != adapter[-1]["content"] and "answered" in status
    with pytest.raises(InvalidRequest, match="choose an adapter"):
        collect(playground_tab.chat_side_by_side(ctx, admin(), "acme", MODEL_ID, "x", [], [], GREEDY))


def test_chat_history_and_system_prompt_reach_the_model():
    history = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
               {"role": "assistant", "content": "hello"}]
    body = playground_tab.chat_request("m", history, "again", SamplingSettings(system_prompt="Be brief.", seed=3))
    assert [(m.role, m.content) for m in body.messages] == [
        ("system", "Be brief."), ("user", "hi"), ("assistant", "hello"), ("user", "again")]
    assert (body.stream, body.seed, body.temperature) == (True, 3, 0.7)


def test_chat_errors_come_from_the_serving_service(running_ctx):
    ctx = running_ctx
    add_tenant(ctx, "acme")
    with pytest.raises(ModelNotFound) as unknown:
        collect(playground_tab.chat(ctx, admin(), "acme", "nope", "hi", [], GREEDY))
    assert unknown.value.message == "The model `nope` does not exist or you do not have access to it."
    with pytest.raises(InvalidRequest, match="type a message"):
        collect(playground_tab.chat(ctx, admin(), "acme", MODEL_ID, "  ", [], GREEDY))
    too_long = SamplingSettings(temperature=0.0, max_tokens=10_000)
    with pytest.raises(PlatformError, match="maximum context length"):
        collect(playground_tab.chat(ctx, admin(), "acme", MODEL_ID, "hi", [], too_long))
    with pytest.raises(InvalidRequest, match="seed='x1'"):
        playground_tab.sampling_settings("", 0.0, 1.0, 8, "x1")


def test_model_choices_are_the_base_model_and_the_tenant_adapters(ctx, peft_files):
    add_tenant(ctx, "acme")
    upload(ctx, "acme", "shouty", peft_files)
    update = playground_tab.model_choices(ctx, admin(), "acme")
    assert update["choices"] == [(f"{MODEL_ID} (base model)", MODEL_ID), ("shouty", "shouty")]
    assert update["value"] == MODEL_ID
    assert playground_tab.model_choices(ctx, admin(), "acme", "shouty")["value"] == "shouty"
    choices, message = playground_tab.refresh_models(ctx, admin(), None, None)
    assert choices["choices"] == [] and "Choose a tenant" in message


# -- stats history ---------------------------------------------------------------------------------
def test_stats_history_keeps_the_last_minutes_at_most_once_per_interval():
    now = [1000.0]
    history = StatsHistory(window_s=60, min_interval_s=1.0, clock=lambda: now[0])
    for t, used in ((1000.0, 1), (1000.5, 2), (1001.0, 3), (1050.0, 4)):
        now[0] = t
        history.observe({"kv_blocks_used": used, "num_running": 0, "lora": None})
    assert [r["value"] for r in records(history.frame({"kv_blocks_used": "used"}))] == [1.0, 3.0, 4.0]
    now[0] = 1070.0
    history.observe({"kv_blocks_used": 5, "num_running": 2})
    history.observe(None)
    assert records(history.frame({"kv_blocks_used": "used", "num_running": "running"})) == [
        {"seconds": -20.0, "value": 4.0, "series": "used"}, {"seconds": -20.0, "value": 0.0, "series": "running"},
        {"seconds": 0.0, "value": 5.0, "series": "used"}, {"seconds": 0.0, "value": 2.0, "series": "running"}]


def test_stats_view_without_engine_stats(ctx):
    summary, slots, cpu, *_ = stats_tab.stats_view(ctx, admin(), StatsHistory())  # engine thread not started
    assert summary.startswith("No engine is running") and slots.empty and cpu.empty
    with pytest.raises(Unauthenticated):
        stats_tab.stats_view(ctx, ConsoleSession(role="tenant", key="x", tenant_name="a"), StatsHistory())
    assert all(o == gr.skip() for o in stats_tab.tick(ctx, None, StatsHistory()))


def test_adapter_names_travel_as_data(ctx, peft_files):
    """Issue 22.1: the console shows the registry's labels for engine adapter names, never parses them."""
    from loraplex.platform.services.stats import AdapterLabel, adapter_labels

    add_tenant(ctx, "acme")
    upload(ctx, "acme", "shouty", peft_files)
    upload(ctx, "acme", "shouty", peft_files)
    route = adapter_service.resolve_adapter(ctx=ctx, tenant_id=_tenant_id(ctx, "acme"), name="shouty")
    with ctx.sessions() as db:
        labels = adapter_labels(session=db)
    assert labels[route.lora_name] == AdapterLabel("acme", "shouty", 2)
    assert stats_tab.display_lora_name(route.lora_name, labels) == "acme/shouty v2"
    assert stats_tab.display_lora_name("9/gone@1", labels) == "9/gone@1"  # deleted since: the engine's name
    assert stats_tab.display_lora_name(None, labels) == ""


def _tenant_id(ctx, name: str) -> int:
    with ctx.sessions() as db:
        return tenant_service.tenant_context(session=db, name=name).tenant_id


def test_console_events_are_not_a_public_api(ctx):
    """Every event is private: not listed in the API docs, not callable by Gradio clients."""
    from loraplex.ui import build_console

    blocks = build_console(ctx)
    assert len(blocks.fns) > 20
    assert {fn.api_visibility for fn in blocks.fns.values()} == {"private"}
    assert blocks.get_api_info()["named_endpoints"] == {}


def test_tab_opening_refreshes_tenants_without_resetting_the_choice(ctx):
    from loraplex.ui.console import tenant_choices_for

    add_tenant(ctx, "acme")
    assert tenant_choices_for(ctx, admin(), None) == (gr.update(choices=["acme"]), "")
    assert tenant_choices_for(ctx, admin(), "acme") == (gr.update(choices=["acme"]), "")
    assert tenant_choices_for(ctx, admin(), "gone") == (gr.update(choices=["acme"], value=None), "")
    assert tenant_choices_for(ctx, login(ctx, add_tenant(ctx, "globex")), "globex") == (gr.skip(), "")


def test_json_schema_box_constrains_the_reply(running_ctx):
    ctx = running_ctx
    add_tenant(ctx, "acme")
    schema_text = '{"type": "object", "properties": {"color": {"enum": ["red", "green"]}}, "required": ["color"]}'
    settings = playground_tab.sampling_settings("", 0.0, 1.0, 32, "", schema_text)
    body = playground_tab.chat_request(MODEL_ID, [], "hi", settings)
    assert body.response_format.json_schema.schema_ == json.loads(schema_text)
    reply = collect(playground_tab.chat(ctx, admin(), "acme", MODEL_ID, "Pick a color", [], settings))[-1][0][-1]
    assert json.loads(reply["content"]) in ({"color": "red"}, {"color": "green"})
    with pytest.raises(InvalidRequest, match="JSON schema: not valid JSON"):
        playground_tab.sampling_settings("", 0.0, 1.0, 8, "", "{nope")
    bad = playground_tab.sampling_settings("", 0.0, 1.0, 8, "", '{"type": "objet"}')
    with pytest.raises(InvalidRequest, match='Unsupported type "objet"'):
        collect(playground_tab.chat(ctx, admin(), "acme", MODEL_ID, "hi", [], bad))


# -- fair-share settings and per-tenant service (issue 21) -----------------------------------------
def test_tenant_weight_and_queueing_limits_round_trip(ctx):
    tenants_tab.create_tenant(ctx, admin(), "gold", "", "", "", "", "3")
    assert tenants_tab.load_tenant(ctx, admin(), "gold")[4:8] == ("3", "", "", "")
    table, message = tenants_tab.save_limits(ctx, admin(), "gold", "", "", "", "", "", "4", "10", "2.5")
    with ctx.sessions() as db:
        stored = tenant_service.get_tenant(session=db, name="gold")
    assert (stored.weight, stored.max_concurrent_requests, stored.max_queued_requests, stored.max_queue_time_s) == (
        3.0, 4, 10, 2.5)  # empty weight = unchanged
    row = records(table)[0]
    assert (row["weight"], row["max concurrent"], row["max queued"], row["max queue s"]) == (3.0, "4", "10", "2.5")
    assert "weight 3, 4 concurrent, 10 queued, 2.5 s queue time" in message
    tenants_tab.save_limits(ctx, admin(), "gold", "", "", "", "", "0.5", "", "", "")
    assert tenants_tab.load_tenant(ctx, admin(), "gold")[4:8] == ("0.5", "", "", "")  # empty limit = unlimited
    with pytest.raises(ValidationError) as bad:
        tenants_tab.save_limits(ctx, admin(), "gold", "", "", "", "", "0", "", "", "")
    assert "`weight`='0'" in error_text(bad.value)


def test_per_tenant_service_table_and_rate_plot():
    def stats(a_tokens: int, b_tokens: int) -> dict:
        return {"num_running": 1, "tenants": [
            {"tenant_id": "acme", "weight": 1.0, "num_waiting": 3, "num_running": 1, "prompt_tokens_served": a_tokens,
             "output_tokens_served": 0, "virtual_counter": float(a_tokens)},
            {"tenant_id": "globex", "weight": 3.0, "num_waiting": 0, "num_running": 0,
             "prompt_tokens_served": 0, "output_tokens_served": b_tokens, "virtual_counter": 2 * b_tokens / 3}]}

    assert records(stats_tab.tenant_service_table(stats(300, 100))) == [
        {"tenant": "acme", "weight": 1.0, "waiting": 3, "running": 1, "prompt tokens served": 300,
         "output tokens served": 0, "virtual counter": 300.0, "share of tokens": "75.0%"},
        {"tenant": "globex", "weight": 3.0, "waiting": 0, "running": 0, "prompt tokens served": 0,
         "output tokens served": 100, "virtual counter": 66.7, "share of tokens": "25.0%"}]
    now = [1000.0]
    history = StatsHistory(window_s=60, min_interval_s=1.0, clock=lambda: now[0])
    history.observe(stats(0, 0))
    now[0] = 1002.0
    history.observe(stats(300, 100))
    assert records(history.tenant_rate_frame()) == [{"seconds": 0.0, "value": 150.0, "series": "acme"},
                                                    {"seconds": 0.0, "value": 50.0, "series": "globex"}]
    assert stats_tab.tenant_service_table(None).empty


def test_a_reload_resumes_the_session_until_it_expires_or_its_key_is_revoked(ctx):
    """Issue 15: a page reload signed the user out. Issue 22.1: one owner of console sessions: the
    token of the gate's cookie is what the page resumes, for ``lifetime_s`` (injected clock), its key
    checked again."""
    from loraplex.ui.console import resume, sign_in_with_session
    from loraplex.ui.session import ConsoleSessions

    now_s = [0.0]
    sessions = ConsoleSessions(ctx, lifetime_s=100.0, clock=lambda: now_s[0])
    key = add_tenant(ctx, "acme")
    token = sessions.open(key)
    assert len(token) == 43 and len(sessions) == 1
    assert sign_in_with_session(ctx, sessions, key, token)[0].tenant_name == "acme"
    with pytest.raises(Unauthenticated, match="allow cookies"):  # the key is right but no session came back
        sign_in_with_session(ctx, sessions, key, None)
    with pytest.raises(Unauthenticated, match="Incorrect API key provided"):
        sign_in_with_session(ctx, sessions, "lpx-wrong", token)  # the service's message for a wrong key
    assert resume(ctx, sessions, token)[0].tenant_name == "acme"
    skipped = resume(ctx, sessions, "forged")
    assert len(skipped) == 13 and all(o == gr.skip() for o in skipped)
    assert resume(ctx, sessions, None) == skipped
    now_s[0] = 99.0
    assert resume(ctx, sessions, token)[0].tenant_name == "acme"
    now_s[0] = 100.0  # lifetime over
    assert resume(ctx, sessions, token) == skipped and len(sessions) == 0
    # a revoked key ends the session at the next reload too
    token = sessions.open(key)
    with ctx.sessions() as db:
        key_id = tenant_service.list_api_keys(session=db, tenant_name="acme")[0].id
        tenant_service.revoke_api_key(session=db, ctx=ctx, tenant_name="acme", key_id=key_id)
    assert resume(ctx, sessions, token) == skipped and len(sessions) == 0
    sessions.close(token)  # signing out twice is harmless


def test_upload_errors_use_the_forms_words(ctx, tmp_path):
    """Issue 15: "got 4 files (field files)" spoke the API's terms."""
    add_tenant(ctx, "acme")
    paths = []
    for name in ("adapter_config.json", "adapter_model.safetensors", "a.json", "b.json"):
        (tmp_path / name).write_text("{}")
        paths.append(str(tmp_path / name))
    with pytest.raises(InvalidRequest) as refused:
        adapters_tab.check_upload(ctx, admin(), "acme", "x", paths)
    assert error_text(refused.value, adapters_tab.UPLOAD_FIELDS) == (
        "**Error:** choose one archive (.zip, .tar.gz) or the two files adapter_config.json and "
        "adapter_model.safetensors; 4 files were chosen (adapter_config.json, adapter_model.safetensors, a.json, "
        "b.json) (check the chosen files)")


# -- evaluate --------------------------------------------------------------------------------------
def test_evaluate_tab_is_tenant_scoped_and_lists_stored_results(running_ctx, peft_files, tmp_path):
    ctx = running_ctx
    acme_key = add_tenant(ctx, "acme")
    globex_key = add_tenant(ctx, "globex")
    upload(ctx, "acme", "shouty", peft_files)
    acme, globex = login(ctx, acme_key), login(ctx, globex_key)
    eval_set = tmp_path / "two.jsonl"
    eval_set.write_text('{"prompt": "Hello", "choices": [" there", " world"], "answer": 0}\n'
                        '{"prompt": "Good", "choices": [" morning", " night"], "answer": " night"}\n')

    tenant_update, _ = evaluate_tab.tenant_choices(ctx, acme, None)
    assert (tenant_update["choices"], tenant_update["value"], tenant_update["interactive"]) == (["acme"], "acme", False)
    assert evaluate_tab.tenant_choices(ctx, admin(), None)[0]["choices"] == ["acme", "globex"]
    checkboxes, history, _ = evaluate_tab.refresh(ctx, acme, "acme", ["gone"])
    assert (checkboxes["choices"], checkboxes["value"], len(history)) == (["shouty"], [], 0)
    # globex can neither see nor run acme's adapter.
    with pytest.raises(NotFound, match="'acme' does not exist"):
        evaluate_tab.refresh(ctx, globex, "acme", [])
    with pytest.raises(ModelNotFound):
        asyncio.run(evaluate_tab.run(ctx, globex, "globex", ["shouty"], str(eval_set)))

    scores, examples, history, message = asyncio.run(evaluate_tab.run(ctx, admin(), "acme", ["shouty"],
                                                                      str(eval_set)))
    assert "results stored" in message
    assert list(scores["model"]) == [MODEL_ID, "shouty"] and list(scores["items"]) == [2, 2]
    assert list(examples.columns) == ["prompt", "expected", MODEL_ID, "shouty"]
    assert list(examples["expected"]) == [" there", " night"]
    [row] = records(history)
    assert (row["tenant"], row["adapter"], row["version"], row["evaluation set"]) == ("acme", "shouty", 1, "two.jsonl")
    assert row["accuracy"] == scores["accuracy"][1] and row["base accuracy"] == scores["accuracy"][0]
    assert len(evaluate_tab.history_table(ctx, globex, "globex")) == 0
    assert len(evaluate_tab.history_table(ctx, acme, "acme")) == 1
    with pytest.raises(InvalidRequest, match="upload an evaluation set"):
        asyncio.run(evaluate_tab.run(ctx, acme, "acme", ["shouty"], None))
    with pytest.raises(InvalidRequest, match="choose at least one adapter"):
        asyncio.run(evaluate_tab.run(ctx, acme, "acme", [], str(eval_set)))
