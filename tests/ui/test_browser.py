"""The console in a real browser: Debian's Chromium, headless, driven by Playwright,
against ``create_app`` + ``mount_console`` served by uvicorn on loopback.

Screenshots go to the test's temporary directory; a failing test lists them
(and a screenshot of the moment it failed) in its message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ui_testlib import ADMIN_KEY, MODEL_ID, PEFT_FILES, make_app, run_server

from loraplex.platform import crud
from loraplex.platform.schemas import TenantCreate
from loraplex.platform.services import tenants as tenant_service

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 30_000
PROMPT = "Hello there"
MAX_TOKENS = 16

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect
expect.set_options(timeout=TIMEOUT_MS)


@contextlib.contextmanager
def paced_engine(live, pause_s: float = 0.05):
    """The live engine sleeps ``pause_s`` after each step, so a streamed reply reaches the browser
    in several updates however fast the machine is (the tiny model can finish 16 tokens within
    one browser frame)."""
    engine = live.app.state.ctx.engine.engine
    step = engine.step

    def paced_step():
        outputs = step()
        time.sleep(pause_s)
        return outputs

    engine.step = paced_step
    try:
        yield
    finally:
        del engine.step


@pytest.fixture(scope="module")
def chromium():
    if shutil.which(CHROMIUM) is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is not installed")
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama_dir):
    """The platform with the console at /ui, its engine running, on a free loopback port."""
    server = run_server(make_app(tmp_path_factory.mktemp("ui-data"), tiny_llama_dir))
    yield server
    server.stop()


class Console:
    """One browser tab on the console, with the few gestures the tests need."""

    def __init__(self, page, url: str, shots: Path) -> None:
        self.page = page
        self.url = url
        self.shots = shots
        self.taken: list[Path] = []
        page.set_default_timeout(TIMEOUT_MS)
        # Nothing leaves the machine: only the server under test is reachable.
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(url)
                   else route.abort())

    def open(self) -> None:
        self.page.goto(self.url + "/ui/")
        self.page.wait_for_selector("#login-key input")

    def sign_in(self, key: str) -> None:
        self.page.fill("#login-key input", key)
        self.page.click("#login-button")

    def tab(self, name: str) -> None:
        self.page.get_by_role("tab", name=name, exact=True).click()

    def field(self, elem_id: str):
        return self.page.locator(f"#{elem_id} textarea, #{elem_id} input").first

    def choose(self, elem_id: str, option: str) -> None:
        self.page.click(f"#{elem_id} input")
        self.page.get_by_role("option", name=option, exact=True).click()

    def set_number(self, elem_id: str, value: str) -> None:
        box = self.page.locator(f"#{elem_id} input[type=number]")
        box.fill(value)
        box.press("Enter")

    def element(self, elem_id: str):
        return self.page.locator(f"#{elem_id}")

    def text(self, elem_id: str) -> str:
        return self.element(elem_id).inner_text()

    def bot_replies(self, elem_id: str) -> list[str]:
        """The assistant messages shown in a chat, whitespace runs collapsed (as HTML renders them)."""
        return [squash(t) for t in self.page.locator(f"#{elem_id} [data-testid=bot]").all_inner_texts()]

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        self.taken.append(path)
        return path

    def assert_no_stack_trace(self) -> None:
        body = self.page.locator("body").inner_text()
        assert "Traceback" not in body and 'File "' not in body


@contextlib.contextmanager
def screenshots_on_failure(*consoles: Console) -> Iterator[None]:
    """Re-raise a failure with a screenshot of each page and the paths of all screenshots taken."""
    try:
        yield
    except Exception as exc:
        paths = []
        for i, console in enumerate(consoles):
            with contextlib.suppress(Exception):
                console.shot(f"failure-{i}")
            paths += console.taken
        raise AssertionError(f"{exc}\nscreenshots: {[str(p) for p in paths]}") from exc


@pytest.fixture
def console(chromium, live, tmp_path) -> Iterator[Console]:
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    yield Console(context.new_page(), live.url, tmp_path)
    context.close()


def squash(text: str) -> str:
    return " ".join(text.split())


def _summary_number(summary: str, pattern: str) -> int:
    match = re.search(pattern, summary)
    assert match, f"{pattern!r} not in {summary!r}"
    return int(match.group(1))


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_admin_and_tenant_walkthrough(console, chromium, live, peft_adapter_dir, tmp_path):
    import openai

    ui = console
    with screenshots_on_failure(ui):
        ui.open()
        ui.sign_in(ADMIN_KEY)
        expect(ui.element("whoami")).to_contain_text("Signed in as admin")
        for name in ("Tenants", "Adapters", "Cache & engine", "Playground"):
            expect(ui.page.get_by_role("tab", name=name, exact=True)).to_be_visible()

        # Tenants: create one, then a key (shown once).
        ui.field("new-tenant-name").fill("acme")
        ui.page.click("#create-tenant")
        expect(ui.element("tenants-message")).to_contain_text("tenant acme created")
        expect(ui.element("tenants-table")).to_contain_text("acme")
        ui.choose("edit-tenant", "acme")
        ui.page.click("#create-key")
        expect(ui.element("tenants-message")).to_contain_text("copy it now")
        tenant_key = ui.field("new-key").input_value()
        assert tenant_key.startswith("lpx-")

        # Fair-share settings of the tenant (issue 21): weight and queueing limits.
        ui.field("edit-weight").fill("2")
        ui.field("edit-max-concurrent").fill("4")
        ui.page.get_by_role("button", name="Save limits").click()
        expect(ui.element("tenants-message")).to_contain_text("weight 2, 4 concurrent, unlimited queued")
        expect(ui.element("tenants-table")).to_contain_text("4")

        # Adapters: check the upload, confirm it, see it listed and loaded.
        ui.tab("Adapters")
        ui.choose("adapters-tenant", "acme")
        ui.field("upload-name").fill("shouty")
        ui.page.set_input_files("#upload-files input[type=file]", [str(peft_adapter_dir / n) for n in PEFT_FILES])
        expect(ui.element("upload-files")).to_contain_text("adapter_model.safetensors")
        expect(ui.element("upload-confirm")).to_be_disabled()
        ui.page.click("#upload-check")
        expect(ui.element("upload-report")).to_contain_text("valid PEFT LoRA adapter")
        expect(ui.element("upload-report")).to_contain_text("rank 8 (server max 8), alpha 16")
        expect(ui.element("upload-report")).to_contain_text("targets: q_proj, v_proj, o_proj in 2 layer(s)")
        expect(ui.element("upload-report")).to_contain_text(
            "checked files: adapter_config.json, adapter_model.safetensors")
        # Issue 15: the picker kept the checked files, so the next pick added to them ("got 4 files").
        # It is emptied after each check; picking the two files again and checking is fine.
        expect(ui.element("upload-files")).to_contain_text("Drop File Here")  # the empty picker
        ui.page.set_input_files("#upload-files input[type=file]", [str(peft_adapter_dir / n) for n in PEFT_FILES])
        expect(ui.element("upload-confirm")).to_be_disabled()  # a new choice needs a new check
        ui.page.click("#upload-check")
        expect(ui.element("upload-report")).to_contain_text("valid PEFT LoRA adapter")
        expect(ui.element("upload-confirm")).to_be_enabled()
        ui.page.click("#upload-confirm")
        expect(ui.element("adapters-message")).to_contain_text("shouty version 1 stored")
        expect(ui.field("upload-name")).to_have_value("")  # the form is reset after the upload
        expect(ui.element("upload-files")).to_contain_text("Drop File Here")
        expect(ui.element("upload-confirm")).to_be_disabled()
        expect(ui.element("adapters-table")).to_contain_text("in CPU cache")

        # Stats before any request: the adapter sits in the CPU cache, no GPU slot holds it.
        ui.tab("Cache & engine")
        expect(ui.element("stats-cpu")).to_contain_text("acme/shouty v1")
        expect(ui.element("stats-slots")).not_to_contain_text("acme/shouty")
        before = ui.text("stats-summary")
        assert _summary_number(before, r"(\d+) generated") == 0

        # Playground: a streamed, greedy reply of the adapter.
        ui.tab("Playground")
        ui.choose("chat-tenant", "acme")
        ui.choose("chat-model", "shouty")
        ui.set_number("chat-temperature", "0")
        ui.set_number("chat-max-tokens", str(MAX_TOKENS))
        ui.page.evaluate("""() => {
            window.seenReplies = new Set();
            const chat = document.querySelector('#chat-main');
            new MutationObserver(() => {
                const bots = chat.querySelectorAll('[data-testid=bot]');
                if (bots.length) window.seenReplies.add(bots[bots.length - 1].innerText);
            }).observe(chat, {subtree: true, childList: true, characterData: true});
        }""")
        ui.field("chat-message").fill(PROMPT)
        with paced_engine(live):  # what is checked is that the reply grows in the page, not speed
            ui.page.click("#chat-send")
            expect(ui.element("chat-status")).to_contain_text("characters from shouty")
        [adapter_reply] = ui.bot_replies("chat-main")
        seen = ui.page.evaluate("() => Array.from(window.seenReplies)")
        assert len([s for s in seen if s.strip()]) >= 3, f"the reply did not stream: {seen}"

        # Side by side: the same message to the base model and to the adapter.
        ui.page.check("#chat-side-by-side input")
        expect(ui.element("chat-base")).to_be_visible()
        ui.page.click("#chat-clear")
        expect(ui.page.locator("#chat-main [data-testid=bot]")).to_have_count(0)
        ui.field("chat-message").fill(PROMPT)
        ui.page.click("#chat-send")
        expect(ui.element("chat-status")).to_contain_text("answered")
        [base_reply] = ui.bot_replies("chat-base")
        assert ui.bot_replies("chat-main") == [adapter_reply]
        assert base_reply != adapter_reply

        # The same requests through the OpenAI-compatible API (official client, tenant key).
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=tenant_key)
        for model, shown in ((MODEL_ID, base_reply), ("shouty", adapter_reply)):
            answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                                    temperature=0, max_tokens=MAX_TOKENS)
            assert squash(answer.choices[0].message.content) == shown

        # Stats after: the adapter took a GPU slot; tokens were generated; KV blocks got cached.
        ui.tab("Cache & engine")
        expect(ui.element("stats-slots")).to_contain_text("acme/shouty v1")
        expect(ui.element("stats-summary")).to_contain_text(re.compile(r"; [1-9]\d* generated"))
        after = ui.text("stats-summary")
        assert _summary_number(after, r"(\d+) cached") > _summary_number(before, r"(\d+) cached")
        expect(ui.element("stats-tenants")).to_contain_text("acme")  # per-tenant service (issue 21)
        expect(ui.element("stats-policy")).to_contain_text("Scheduling policy")
        ui.tab("Adapters")
        expect(ui.element("adapters-table")).to_contain_text("in GPU slot 0")

        for name in ("Tenants", "Adapters", "Cache & engine", "Playground"):
            ui.tab(name)
            ui.page.wait_for_timeout(1000)
            ui.shot(f"admin-{name.split()[0].lower()}")

    # The tenant's own view: its adapters, playground and usage only.
    context = chromium.new_context(viewport={"width": 1400, "height": 1000})
    tenant = Console(context.new_page(), live.url, tmp_path)
    try:
        with screenshots_on_failure(ui, tenant):
            tenant.open()
            tenant.sign_in(tenant_key)
            expect(tenant.element("whoami")).to_contain_text("Signed in as tenant acme")
            expect(tenant.element("adapters-table")).to_contain_text("shouty")
            for hidden in ("Tenants", "Cache & engine"):
                expect(tenant.page.get_by_role("tab", name=hidden, exact=True)).to_have_count(0)
            assert live.app.state.ctx.usage.flush()  # usage is written by a background writer
            tenant.tab("Usage")
            with live.app.state.ctx.sessions() as db:
                [(_, requests, prompt, completion)] = crud.usage_by_tenant(session=db)
            assert requests == 5  # playground: 1 + 2 (side by side); API: 2
            expect(tenant.element("usage-table")).to_contain_text(f"{requests}")
            expect(tenant.element("usage-table")).to_contain_text(str(prompt + completion))
            tenant.shot("tenant-usage")
            tenant.tab("Playground")
            tenant.page.wait_for_timeout(1000)
            tenant.shot("tenant-playground")
            # The JSON schema box: the reply follows the schema (response_format).
            tenant.choose("chat-model", "shouty")
            tenant.set_number("chat-temperature", "0")
            tenant.field("chat-json-schema").fill(
                '{"type": "object", "properties": {"mood": {"enum": ["calm", "loud"]}}, "required": ["mood"]}')
            tenant.field("chat-message").fill(PROMPT)
            tenant.page.click("#chat-send")
            expect(tenant.element("chat-status")).to_contain_text("characters from shouty")
            [reply] = tenant.bot_replies("chat-main")
            assert json.loads(reply) in ({"mood": "calm"}, {"mood": "loud"}), reply
    finally:
        context.close()


def test_bad_inputs_show_the_service_message(console, live, tmp_path):
    ctx = live.app.state.ctx
    with ctx.sessions() as db:
        tenant_service.create_tenant(session=db, ctx=ctx, spec=TenantCreate(name="globex"))
    not_an_archive = tmp_path / "adapter.zip"
    not_an_archive.write_bytes(b"definitely not a zip file")
    three_more = [tmp_path / "a.json", tmp_path / "b.json"]
    for path in three_more:
        path.write_text("{}")
    three_more = [str(p) for p in three_more]
    ui = console
    with screenshots_on_failure(ui):
        ui.open()
        ui.sign_in("lpx-wrong-key")
        expect(ui.element("login-message")).to_contain_text("Error: Incorrect API key provided.")
        expect(ui.element("whoami")).to_be_hidden()
        ui.assert_no_stack_trace()

        ui.sign_in(ADMIN_KEY)
        # Issue 15: "Edit a tenant" listed nothing until Refresh was clicked.
        ui.choose("edit-tenant", "globex")
        expect(ui.element("create-key")).to_be_visible()
        # Issue 15: a page reload signed the user out. The session lasts until "Sign out".
        ui.page.reload()
        expect(ui.element("whoami")).to_contain_text("Signed in as admin")
        expect(ui.element("tenants-table")).to_contain_text("globex")
        for name in ("Tenants", "Adapters", "Cache & engine", "Playground"):
            expect(ui.page.get_by_role("tab", name=name, exact=True)).to_be_visible()
        ui.field("new-tenant-name").fill("bad name")
        ui.page.click("#create-tenant")
        expect(ui.element("tenants-message")).to_contain_text("name='bad name': String should match pattern")

        ui.tab("Adapters")
        ui.choose("adapters-tenant", "globex")
        ui.field("upload-name").fill("broken")
        ui.page.set_input_files("#upload-files input[type=file]", [str(not_an_archive)])
        expect(ui.element("upload-files")).to_contain_text("adapter.zip")
        ui.page.click("#upload-check")
        expect(ui.element("upload-report")).to_contain_text(
            "Error: 'adapter.zip' is neither a .zip nor a .tar.gz archive (by its content) (check the chosen files)")
        expect(ui.element("upload-confirm")).to_be_disabled()
        ui.assert_no_stack_trace()
        ui.shot("bad-archive")
        # Too many files: said in the form's own words, not the API's ("got 3 files (field files)").
        ui.page.set_input_files("#upload-files input[type=file]", [str(not_an_archive), *three_more[:2]])
        ui.page.click("#upload-check")
        expect(ui.element("upload-report")).to_contain_text(
            "Error: choose one archive (.zip, .tar.gz) or the two files adapter_config.json and "
            "adapter_model.safetensors; 3 files were chosen (adapter.zip, a.json, b.json) (check the chosen files)")

        ui.page.click("#logout-button")  # a fresh page: signed out, nothing of the session left
        expect(ui.element("login-key")).to_be_visible()
        expect(ui.element("whoami")).to_be_hidden()
        ui.page.reload()  # and it stays signed out
        expect(ui.element("login-key")).to_be_visible()
        expect(ui.element("whoami")).to_be_hidden()


EVAL_ITEMS = [
    {"prompt": "The capital of France is", "choices": [" Paris", " Rome", " a blue whale"], "answer": 0},
    {"prompt": "Two plus two equals", "choices": [" four", " five"], "answer": " four"},
    {"prompt": "The sky is", "choices": [" blue", " green", " plaid"], "answer": 2},
    {"prompt": "LoRA adapters are", "choices": [" low-rank", " high-rank"], "answer": 1},
]


def _table_rows(ui: Console, elem_id: str) -> list[list[str]]:
    """A Gradio dataframe's shown cells, row by row (its grid rows, not the hidden sizing table)."""
    rows = ui.page.locator(f"#{elem_id} [role=row][data-index]")
    return [[squash(c) for c in rows.nth(i).locator("[role=gridcell]").all_inner_texts()]
            for i in range(rows.count())]


def test_evaluate_tab_scores_base_and_adapter_like_hf_peft(console, live, peft_adapter_dir, tiny_llama_dir,
                                                           tmp_path):
    import json

    import httpx
    from eval_reference import continuation_loglik, hf_model
    from transformers import AutoTokenizer

    from ui_testlib import PEFT_FILES as FILES

    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as admin:
        assert admin.post("/admin/tenants", json={"name": "initech"}).status_code == 201
        files = [("files", (n, (peft_adapter_dir / n).read_bytes(), "application/octet-stream")) for n in FILES]
        assert admin.post("/admin/tenants/initech/adapters", data={"name": "sharp"}, files=files).status_code == 201
        tenant_key = admin.post("/admin/tenants/initech/keys").json()["key"]
    eval_file = tmp_path / "mc.jsonl"
    eval_file.write_text("".join(json.dumps(item) + "\n" for item in EVAL_ITEMS))

    # The independent reference: HF transformers (+ PEFT), float32.
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    expected = {}
    for label, model in ((MODEL_ID, hf_model(tiny_llama_dir)), ("sharp", hf_model(tiny_llama_dir, peft_adapter_dir))):
        correct, right = 0, []
        for item in EVAL_ITEMS:
            answer = item["choices"].index(item["answer"]) if isinstance(item["answer"], str) else item["answer"]
            logliks = [continuation_loglik(model, tok, item["prompt"], c) for c in item["choices"]]
            correct += max(range(len(logliks)), key=lambda j: (logliks[j], -j)) == answer
            right.append(logliks[answer])
        expected[label] = (correct, sum(right) / len(right))

    ui = console
    with screenshots_on_failure(ui):
        ui.open()
        ui.sign_in(tenant_key)
        expect(ui.element("whoami")).to_contain_text("Signed in as tenant initech")
        ui.tab("Evaluate")
        expect(ui.field("eval-tenant")).to_have_value("initech")
        ui.page.get_by_label("sharp", exact=True).check()
        ui.page.set_input_files("#eval-file input[type=file]", [str(eval_file)])
        expect(ui.element("eval-file")).to_contain_text("mc.jsonl")
        ui.page.click("#eval-run")
        expect(ui.element("eval-message")).to_contain_text("results stored")
        expect(ui.page.locator("#eval-scores [role=row][data-index]")).to_have_count(2)
        expect(ui.element("eval-scores")).to_contain_text("sharp")
        expect(ui.element("eval-history")).to_contain_text("mc.jsonl")
        rows = _table_rows(ui, "eval-scores")
        assert [r[:2] for r in rows] == [[MODEL_ID, "base"], ["sharp", "1"]]
        for row in rows:
            correct, mean_loglik = expected[row[0]]
            assert int(row[2]) == correct and int(row[3]) == len(EVAL_ITEMS)
            assert float(row[4]) == pytest.approx(correct / len(EVAL_ITEMS), abs=1e-3)
            assert float(row[5]) == pytest.approx(mean_loglik, abs=2e-4)
        examples = _table_rows(ui, "eval-examples")
        assert [r[:2] for r in examples] == [[squash(i["prompt"]), squash(i["choices"][
            i["choices"].index(i["answer"]) if isinstance(i["answer"], str) else i["answer"]])] for i in EVAL_ITEMS[:3]]
        [stored] = _table_rows(ui, "eval-history")
        assert stored[:6] == ["initech", "sharp", "1", "mc.jsonl", "multiple_choice", str(len(EVAL_ITEMS))]
        ui.assert_no_stack_trace()
        ui.shot("tenant-evaluate")

        # A bad line is refused with the service's message, nothing stored.
        eval_file.write_text('{"prompt": "a", "choices": ["x", "y"], "answer": 5}\n')
        ui.page.click("#eval-file button[aria-label=Clear]")
        ui.page.set_input_files("#eval-file input[type=file]", [str(eval_file)])
        ui.page.click("#eval-run")
        expect(ui.element("eval-message")).to_contain_text(
            "Error: evaluation set line 1: answer=5 must be a choice's text or its index in 0..1 (field file)")
        assert len(_table_rows(ui, "eval-history")) == 1
