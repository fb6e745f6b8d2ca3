"""Adapter evaluations (services/evaluation.py, /v1/evaluations) against HF transformers +
PEFT in float32: per-item log-likelihoods to 1e-4, accuracy counted from them, results
stored per adapter version and visible only to their tenant (and the admin)."""

from __future__ import annotations

import asyncio
import json

import pytest
import sqlalchemy as sa
from eval_reference import continuation_loglik, greedy_text, hf_model
from platform_testlib import adapter_members, make_peft_adapter, make_settings, new_tenant, zip_bytes
from transformers import AutoTokenizer

from loraplex.platform.db import downgrade_database, make_db_engine, upgrade_database
from loraplex.platform.errors import InvalidRequest, PayloadTooLarge
from loraplex.platform.services import evaluation as evaluation_service
from loraplex.platform.services import tenants as tenant_service

MC_ITEMS = [
    {"prompt": "The capital of France is", "choices": [" Paris", " Rome", " a small blue whale"], "answer": 0},
    {"prompt": "Two plus two equals", "choices": [" four", " five"], "answer": " four"},
    {"prompt": "LoRA adapters are", "choices": [" low-rank", " high-rank", " unranked"], "answer": 0},
    {"prompt": "Water boils at", "choices": [" 100 degrees", " 10 degrees"], "answer": 1},
    {"prompt": "The sky is", "choices": [" blue", " green", " red", " plaid"], "answer": 3},
    {"prompt": "A paged KV cache stores", "choices": [" keys and values", " nothing"], "answer": 0},
]


def jsonl(items) -> bytes:
    return "".join(json.dumps(i) + "\n" for i in items).encode()


@pytest.fixture(scope="module")
def peft_dirs(tiny_llama_dir, tmp_path_factory):
    """Two versions of one adapter (different weights)."""
    return (make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("v1"), seed=21, b_std=0.8),
            make_peft_adapter(tiny_llama_dir, tmp_path_factory.mktemp("v2"), seed=22, b_std=0.8))


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, peft_dirs):
    """Per model ("base", "v1", "v2"): [[loglik of each choice] per item] from HF (+ PEFT)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    models = {"base": hf_model(tiny_llama_dir), "v1": hf_model(tiny_llama_dir, peft_dirs[0]),
              "v2": hf_model(tiny_llama_dir, peft_dirs[1])}
    return tok, models, {label: [[continuation_loglik(m, tok, it["prompt"], c) for c in it["choices"]]
                                 for it in MC_ITEMS] for label, m in models.items()}


def upload(admin, tenant: str, name: str, folder) -> None:
    response = admin.post(f"/admin/tenants/{tenant}/adapters", data={"name": name},
                          files={"file": ("a.zip", zip_bytes(adapter_members(folder)), "application/zip")})
    assert response.status_code == 201, response.text


def answer_index(item) -> int:
    return item["choices"].index(item["answer"]) if isinstance(item["answer"], str) else item["answer"]


def expected_scores(logliks):
    """(accuracy, mean log-likelihood of the right answers) from per-choice log-likelihoods."""
    correct = sum(max(range(len(ll)), key=lambda j: (ll[j], -j)) == answer_index(it)
                  for it, ll in zip(MC_ITEMS, logliks))
    return correct / len(MC_ITEMS), sum(ll[answer_index(it)] for it, ll in zip(MC_ITEMS, logliks)) / len(MC_ITEMS)


def test_multiple_choice_matches_hf_peft_and_is_stored_per_version_and_tenant(serve, peft_dirs, reference):
    _, _, ref = reference
    live = serve()
    ctx = live.ctx
    key_a, key_b = new_tenant(live, "alpha"), new_tenant(live, "beta")
    with live.admin() as admin:
        upload(admin, "alpha", "sharp", peft_dirs[0])
    with ctx.sessions() as db:
        alpha = tenant_service.tenant_context(session=db, name="alpha")
    eval_set = evaluation_service.parse_eval_set(jsonl(MC_ITEMS), name="mc.jsonl", settings=ctx.settings)

    # At most eval_max_concurrent_requests (2) engine requests in flight, over all runs.
    in_flight, peak = 0, 0
    generate = ctx.engine.generate

    async def counting_generate(*args, **kwargs):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            async for output in generate(*args, **kwargs):
                yield output
        finally:
            in_flight -= 1

    async def two_runs():  # e.g. two console users at once: they share the limit
        return await asyncio.gather(*(evaluation_service.run_evaluation(
            ctx=ctx, tenant=alpha, adapter_names=["sharp"], eval_set=eval_set) for _ in range(2)))

    ctx.engine.generate = counting_generate
    try:
        report, again = asyncio.run(two_runs())
    finally:
        del ctx.engine.generate
    assert peak == 2
    # Two runs batched together see different batch compositions: same answers, logliks equal
    # to float32 summation order (the batch-invariance tests pin tokens, not last bits).
    for first, second in zip(report.models, again.models):
        assert [(i.correct, i.output) for i in second.items] == [(i.correct, i.output) for i in first.items]
        for i, j in zip(first.items, second.items):
            assert j.loglik == pytest.approx(i.loglik, abs=1e-4)
            assert j.choice_logliks == pytest.approx(i.choice_logliks, abs=1e-4)
    assert [m.model for m in report.models] == ["tiny", "sharp"]
    for score, label in ((report.base, "base"), (report.adapters[0], "v1")):
        for item_score, ref_logliks in zip(score.items, ref[label]):
            assert item_score.choice_logliks == pytest.approx(ref_logliks, abs=1e-4)
        accuracy, mean_loglik = expected_scores(ref[label])
        assert score.accuracy == accuracy
        assert score.mean_loglik == pytest.approx(mean_loglik, abs=1e-4)
    assert report.base.mean_loglik != pytest.approx(report.adapters[0].mean_loglik, abs=1e-3)

    with live.tenant(key_a) as a, live.tenant(key_b) as b, live.admin() as admin:
        rows = a.get("/v1/evaluations").json()
        assert sorted(r["run_id"] for r in rows) == sorted((report.run_id, again.run_id))
        [row] = [r for r in rows if r["run_id"] == report.run_id]
        assert (row["adapter"], row["version"], row["tenant"], row["num_items"]) == ("sharp", 1, "alpha", 6)
        assert row["accuracy"] == report.adapters[0].accuracy
        assert row["base_accuracy"] == report.base.accuracy
        assert row["mean_loglik"] == pytest.approx(expected_scores(ref["v1"])[1], abs=1e-4)
        assert row["examples"][0] == {"prompt": MC_ITEMS[0]["prompt"], "expected": " Paris",
                                      "base": report.base.items[0].output,
                                      "adapter": report.adapters[0].items[0].output}
        # beta sees nothing of alpha's, and "sharp" answers as a name that never existed.
        assert b.get("/v1/evaluations").json() == []
        assert b.get("/v1/evaluations", params={"adapter": "sharp"}).json() == []
        missing = b.post("/v1/evaluations", params={"adapter": "never-was"}, content=jsonl(MC_ITEMS[:1]))
        theirs = b.post("/v1/evaluations", params={"adapter": "sharp"}, content=jsonl(MC_ITEMS[:1]))
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["error"]["message"] == missing.json()["error"]["message"].replace("never-was", "sharp")

        # Version 2 through the API: each version keeps its own scores.
        upload(admin, "alpha", "sharp", peft_dirs[1])
        response = a.post("/v1/evaluations", params={"adapter": "sharp", "name": "mc.jsonl"},
                          content=jsonl(MC_ITEMS), headers={"Content-Type": "application/jsonl"})
        assert response.status_code == 201, response.text
        [new] = response.json()
        rows = a.get("/v1/evaluations", params={"adapter": "sharp"}).json()
        assert [r["version"] for r in rows] == [2, 1, 1] and rows[0]["run_id"] == new["run_id"]
        accuracy, mean_loglik = expected_scores(ref["v2"])
        assert rows[0]["accuracy"] == accuracy
        assert rows[0]["mean_loglik"] == pytest.approx(mean_loglik, abs=1e-4)
        assert rows[0]["base_mean_loglik"] == pytest.approx(row["base_mean_loglik"], abs=1e-5)
        assert [r["tenant"] for r in admin.get("/admin/evaluations").json()] == ["alpha"] * 3
        assert admin.get("/admin/evaluations", params={"tenant": "beta"}).json() == []


def test_generation_items_match_hf_greedy_and_reference_loglik(serve, peft_dirs, reference, tiny_llama_dir):
    tok, models, _ = reference
    live = serve()
    key = new_tenant(live, "alpha")
    with live.admin() as admin:
        upload(admin, "alpha", "sharp", peft_dirs[0])
    max_new = live.ctx.settings.eval_max_new_tokens
    prompts = ["Once upon a time", "The model said", "Adapters"]
    # Item 0's reference is the adapter's own greedy text (so the adapter gets it right).
    adapter_text = greedy_text(models["v1"], tok, prompts[0], max_new)
    assert evaluation_service.normalize_answer(adapter_text)
    items = [{"prompt": prompts[0], "reference": adapter_text.upper() + "!"},
             {"prompt": prompts[1], "reference": " nothing at all"},
             {"prompt": prompts[2], "reference": " serve many tenants"}]
    with live.tenant(key) as a:
        response = a.post("/v1/evaluations", params={"adapter": "sharp"}, content=jsonl(items))
    assert response.status_code == 201, response.text
    [row] = response.json()
    assert row["task"] == "generation"
    for label, acc_key, ll_key, output_key in (("base", "base_accuracy", "base_mean_loglik", "base"),
                                                ("v1", "accuracy", "mean_loglik", "adapter")):
        model = models[label]
        texts = [greedy_text(model, tok, it["prompt"], max_new) for it in items]
        correct = sum(evaluation_service.normalize_answer(t) == evaluation_service.normalize_answer(it["reference"])
                      for t, it in zip(texts, items))
        assert row[acc_key] == correct / 3
        logliks = [continuation_loglik(model, tok, it["prompt"], it["reference"]) for it in items]
        assert row[ll_key] == pytest.approx(sum(logliks) / 3, abs=1e-4)
        assert [e[output_key] for e in row["examples"]] == texts
    assert row["accuracy"] >= 1 / 3


@pytest.mark.parametrize(("data", "message"), [
    (b'{"prompt": "a", "choices": ["x", "y"], "answer": 0}\n{"prompt": "b", "choices": ["x"', "line 2: not valid JSON"),
    (b'{"prompt": "a", "choices": ["x", "y"], "answer": 2}\n', "line 1: answer=2 must be a choice's text or its index"),
    (b'{"prompt": "a", "choices": ["x", "y"], "answer": "z"}\n', "line 1: answer='z' is not one of the choices"),
    (b'{"prompt": "a", "reference": "b", "score": 1}\n', "line 1: unknown ['score'] field(s)"),
    (b'{"prompt": "a", "choices": ["x", "y"], "answer": 0}\n{"prompt": "a", "reference": "b"}\n',
     "line 2: a generation item after multiple_choice items"),
    (b'["prompt"]\n', "line 1: expected a JSON object, got list"),
    (b"\n\n", "the evaluation set holds no item"),
    (b"\xff\xfe", "the evaluation set is not UTF-8 text"),
    (b'{"prompt": "a", "reference": "b"}\n' * 4, "line 4: more than eval_max_items=3 items"),
])
def test_bad_eval_sets_are_refused_with_the_line(tmp_path, data, message):
    settings = make_settings(tmp_path, eval_max_items=3)
    with pytest.raises(InvalidRequest) as info:
        evaluation_service.parse_eval_set(data, name="x.jsonl", settings=settings)
    assert message in info.value.message
    assert info.value.param == "file"


def test_eval_set_size_bound_and_http_errors(serve, tmp_path):
    settings = make_settings(tmp_path, eval_max_file_bytes=64)
    with pytest.raises(PayloadTooLarge):
        evaluation_service.parse_eval_set(b"x" * 65, name="x.jsonl", settings=settings)
    live = serve(eval_max_file_bytes=200)
    key = new_tenant(live, "alpha")
    with live.tenant(key) as a:
        too_big = a.post("/v1/evaluations", params={"adapter": "x"}, content=b"{}" * 101)
        assert too_big.status_code == 413
        assert "eval_max_file_bytes=200" in too_big.json()["error"]["message"]
        bad = a.post("/v1/evaluations", params={"adapter": "x"}, content=b'{"prompt": 1, "reference": "b"}')
        assert bad.status_code == 400
        assert bad.json()["error"] == {"message": "evaluation set line 1: 'prompt' must be a non-empty string",
                                       "type": "invalid_request_error", "param": "file", "code": "invalid_eval_set"}
        long_name = a.post("/v1/evaluations", params={"adapter": "x", "name": "n" * 129},
                           content=b'{"prompt": "a", "reference": "b"}')
        assert long_name.status_code == 400 and long_name.json()["error"]["param"] == "name"
        no_adapter = a.post("/v1/evaluations", content=b'{"prompt": "a", "reference": "b"}')
        assert no_adapter.status_code == 400
        assert no_adapter.json()["error"]["param"] == "adapter"


def test_migration_adds_and_drops_only_the_evaluations_table(database_url, tmp_path):
    engine = make_db_engine(database_url or f"sqlite:///{tmp_path / 'registry.db'}")
    upgrade_database(engine, "0003_version_ids_never_reused")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO tenants (name, max_adapters, max_upload_mb, created_at) "
                             "VALUES ('kept', 1, 1.0, CURRENT_TIMESTAMP)"))
    upgrade_database(engine, "0004_add_adapter_evaluations")
    assert "adapter_evaluations" in sa.inspect(engine).get_table_names()
    downgrade_database(engine, "0003_version_ids_never_reused")
    names = set(sa.inspect(engine).get_table_names())
    assert "adapter_evaluations" not in names and "tenants" in names
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT name FROM tenants")).scalars().all() == ["kept"]
    engine.dispose()
