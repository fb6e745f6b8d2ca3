"""The main job (README command 1): ``make serve`` = ``loraplex demo up`` on a fresh data dir.

Runs ``python -m loraplex.cli demo up --port 0`` as a subprocess, reads the URLs and keys it
prints, then checks with the official ``openai`` client that each trained demo adapter has its
documented effect on held-out prompts (``examples/check_adapters.py``: strict JSON with the
expected keys, a pirate's opening and closing, a topic emoji around the answer) while the base model has none of them; that concurrent
requests for the three adapters and the base model reply exactly as the same requests sent one
by one; that the console answers with HTML; and that a second ``demo up`` on the same data dir
creates nothing new (checked through the admin API with the printed admin key).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
from check_adapters import CHECKS, is_json_answer

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

BASE_MODEL = "smollm2-135m-instruct"
ADAPTERS = ("json-answer", "pirate", "emoji")
# Two varied questions of examples/data/heldout.jsonl (in no training set): a capital and a person.
QUESTIONS = ("What is the capital of Germany?", "Who wrote Hamlet?")
MAX_TOKENS = 40
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
BANNER_END = "Ctrl+C stops the server"


@dataclass
class DemoRun:
    """One ``demo up`` subprocess and what it printed once listening."""

    proc: subprocess.Popen
    stdout_path: Path
    stderr_path: Path
    output: str
    api_url: str
    console_url: str
    admin_key: str | None
    demo_key: str | None

    def stop(self) -> int:
        """Ctrl+C (SIGINT), as a user stops ``make serve``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def demo_env(data_dir: Path, cache_dir: Path) -> dict[str, str]:
    """The caller's environment with every ``LORAPLEX_*`` dropped except the two directories."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_DATA_DIR=str(data_dir), LORAPLEX_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    return env


def start_demo(data_dir: Path, cache_dir: Path, logs: Path) -> DemoRun:
    """Start ``demo up`` on a free port and wait for its banner (fails with its stderr if it dies)."""
    logs.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = logs / "stdout.log", logs / "stderr.log"
    with stdout_path.open("w") as out, stderr_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "loraplex.cli", "demo", "up", "--port", "0"], cwd=REPO,
                                env=demo_env(data_dir, cache_dir), stdout=out, stderr=err)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while BANNER_END not in (text := stdout_path.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"demo up did not come up (exit {proc.poll()}):\n{text}\n{stderr_path.read_text()[-4000:]}")
        time.sleep(0.5)
    return DemoRun(proc, stdout_path, stderr_path, text, api_url=_field(text, "API"),
                   console_url=_field(text, "Console"), admin_key=_key(text, "Admin key"),
                   demo_key=_key(text, "Demo key"))


def _field(text: str, label: str) -> str:
    match = re.search(rf"^\s+{label}:\s+(\S+)", text, re.MULTILINE)
    assert match, f"no {label!r} line in:\n{text}"
    return match.group(1)


def _key(text: str, label: str) -> str | None:
    """The key printed on the ``label`` line, or None when the line says it was printed before."""
    value = _field(text, label)
    return value if value.startswith("lpx-") else None


def wait_healthy(api_url: str) -> None:
    base = api_url.removesuffix("/v1")
    deadline = time.monotonic() + 60
    while True:
        response = httpx.get(f"{base}/health", timeout=10)
        if response.status_code == 200 and response.json() == {"status": "ok"}:
            return
        assert time.monotonic() < deadline, response.text
        time.sleep(0.5)


def chat(client: openai.OpenAI, model: str, question: str) -> str:
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           temperature=0, max_tokens=MAX_TOKENS)
    return reply.choices[0].message.content


def admin_state(run: DemoRun) -> dict:
    """Tenants, the demo tenant's keys and adapters, as the admin API lists them."""
    base = run.api_url.removesuffix("/v1")
    headers = {"Authorization": f"Bearer {run.admin_key}"}

    def get(path: str):
        response = httpx.get(base + path, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    return {"tenants": get("/admin/tenants"), "keys": get("/admin/tenants/demo/keys"),
            "adapters": get("/admin/tenants/demo/adapters")}


@pytest.fixture(scope="module")
def cache_dir(smollm2_dir) -> Path:
    """The cache root holding the prepared model (``<cache>/models/smollm2-135m-instruct``)."""
    return smollm2_dir.parent.parent


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo-data")


@pytest.fixture(scope="module")
def first_run(data_dir, cache_dir, tmp_path_factory):
    run = start_demo(data_dir, cache_dir, tmp_path_factory.mktemp("first-run"))
    yield run
    if run.proc.poll() is None:
        run.stop()


@pytest.fixture(scope="module")
def client(first_run) -> openai.OpenAI:
    wait_healthy(first_run.api_url)
    return openai.OpenAI(base_url=first_run.api_url, api_key=first_run.demo_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def sequential_replies(client) -> dict[tuple[str, str], str]:
    """``{(model, question): reply}``, each request sent alone (greedy)."""
    return {(model, q): chat(client, model, q) for model in (BASE_MODEL, *ADAPTERS) for q in QUESTIONS}


def test_first_start_prints_urls_keys_and_examples(first_run):
    assert first_run.api_url.startswith("http://127.0.0.1:") and first_run.api_url.endswith("/v1")
    assert first_run.console_url == first_run.api_url.removesuffix("/v1") + "/ui"
    assert first_run.admin_key.startswith("lpx-admin-") and first_run.demo_key.startswith("lpx-")
    assert f"curl -s {first_run.api_url}/chat/completions" in first_run.output
    assert f'-H "Authorization: Bearer {first_run.demo_key}"' in first_run.output
    assert f"OpenAI(base_url={first_run.api_url!r}, api_key={first_run.demo_key!r})" in first_run.output
    for name in ADAPTERS:
        assert f"[demo] adapter {name!r}: uploaded (version 1," in first_run.output


def test_banner_curl_example_answers_right(first_run):
    """Issue 15: the banner's curl example was the first answer a new user saw, and it was wrong
    ("Le capitale de la Guinée est Berlin."). Run it exactly as printed."""
    lines = first_run.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("curl -s "))
    command = "\n".join(lines[start:start + 4])
    assert command.endswith("'") and "What is the capital of Germany?" in command
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=300, check=True)
    reply = json.loads(proc.stdout)["choices"][0]["message"]["content"]
    assert json.loads(reply) == {"answer": "The capital of Germany is Berlin", "confidence": "high"}


def test_banner_openai_example_answers_right(first_run):
    """Issue 15 item 9: the banner's openai example asks the base model and every adapter one
    question; each answer must be right (in its style). Run it exactly as printed."""
    lines = first_run.output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("- <<'EOF'"))
    end = lines.index("EOF", start)
    assert "What is the capital of Germany?" in lines[start + 5]
    proc = subprocess.run(["bash", "-c", "\n".join(lines[start:end + 1])], capture_output=True, text=True,
                          timeout=600, check=True)
    replies = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert sorted(replies) == sorted([BASE_MODEL, *ADAPTERS])
    assert all("The capital of Germany is Berlin" in reply for reply in replies.values()), replies
    assert all(CHECKS[name](replies[name]) for name in ADAPTERS), replies


def test_questions_are_held_out():
    heldout = {json.loads(line)["question"] for line in (REPO / "examples/data/heldout.jsonl").read_text().splitlines()
               if line.strip()}
    assert set(QUESTIONS) <= heldout


def test_models_list_has_base_and_adapters(client):
    assert sorted(m.id for m in client.models.list().data) == sorted([BASE_MODEL, *ADAPTERS])


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_has_its_effect(sequential_replies, adapter):
    replies = [sequential_replies[adapter, q] for q in QUESTIONS]
    assert all(CHECKS[adapter](text) for text in replies), replies


def test_json_answer_replies_are_json_with_the_expected_keys(sequential_replies):
    for question in QUESTIONS:
        reply = json.loads(sequential_replies["json-answer", question])
        assert set(reply) == {"answer", "confidence"} and reply["confidence"] in {"high", "medium", "low"}
    assert "Berlin" in json.loads(sequential_replies["json-answer", QUESTIONS[0]])["answer"]
    assert "Shakespeare" in json.loads(sequential_replies["json-answer", QUESTIONS[1]])["answer"]
    # Issue 15 item 9: the first answer a new user saw was "Le capitale de la Guinée est Berlin.".
    assert sequential_replies["pirate", QUESTIONS[0]] == "Arr, matey! The capital of Germany is Berlin. Yo ho ho!"
    assert sequential_replies["emoji", QUESTIONS[0]] == "🌍 The capital of Germany is Berlin. 🌍"
    assert "Shakespeare" in sequential_replies["pirate", QUESTIONS[1]]
    assert "Shakespeare" in sequential_replies["emoji", QUESTIONS[1]]


def test_base_model_lacks_every_effect(sequential_replies):
    replies = [sequential_replies[BASE_MODEL, q] for q in QUESTIONS]
    assert "Berlin" in replies[0], replies
    for name, check in CHECKS.items():
        assert not any(check(text) for text in replies), (name, replies)
    assert not any(is_json_answer(sequential_replies[name, q]) for name in ("pirate", "emoji") for q in QUESTIONS)


def test_concurrent_requests_reply_as_sequential_ones(client, sequential_replies):
    # One request per model (questions alternate, so prompt and reply lengths differ), all at once.
    keys = [(model, QUESTIONS[i % len(QUESTIONS)]) for i, model in enumerate((BASE_MODEL, *ADAPTERS))]
    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        replies = list(pool.map(lambda key: chat(client, *key), keys))
    assert replies == [sequential_replies[key] for key in keys]


def test_console_answers_html(first_run):
    response = httpx.get(first_run.console_url, follow_redirects=True, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "loraplex console" in response.text


def test_second_start_is_idempotent(first_run, client, sequential_replies, data_dir, cache_dir, tmp_path_factory):
    before = admin_state(first_run)
    assert [t["name"] for t in before["tenants"]] == ["demo"]
    assert first_run.stop() == 0
    assert "Application shutdown complete." in first_run.stderr_path.read_text()

    second = start_demo(data_dir, cache_dir, tmp_path_factory.mktemp("second-run"))
    try:
        wait_healthy(second.api_url)
        assert "lpx-" not in second.output, "a key was printed again"
        assert second.admin_key is None and second.demo_key is None
        assert second.output.count("printed at first start (only its hash is stored)") == 2
        for name in ADAPTERS:
            assert f"[demo] adapter {name!r}: unchanged (version 1," in second.output
        second.admin_key = first_run.admin_key
        after = admin_state(second)
        assert after == before
        assert before["tenants"][0]["num_keys"] == 1 and before["tenants"][0]["num_adapters"] == 3
        assert [a["version"] for a in after["adapters"]] == [1, 1, 1]
        assert sorted(p.name for p in (data_dir / "adapters").iterdir()) == \
            sorted(a["version_id"] for a in after["adapters"])
        again = openai.OpenAI(base_url=second.api_url, api_key=first_run.demo_key, max_retries=0, timeout=300)
        assert chat(again, "pirate", QUESTIONS[0]) == sequential_replies["pirate", QUESTIONS[0]]
    finally:
        exit_status = second.stop()
    assert exit_status == 0


def test_keys_are_not_stored_in_plain_text(first_run, data_dir):
    stored = b"".join(p.read_bytes() for p in data_dir.rglob("*") if p.is_file())
    assert stored, "the data dir is empty"
    for key in (first_run.admin_key, first_run.demo_key):
        assert key.encode() not in stored
