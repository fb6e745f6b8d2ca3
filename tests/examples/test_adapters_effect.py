"""The committed demo adapters (examples/adapters/) change SmolLM2's replies as documented.

Reference: transformers + PEFT load each adapter and generate greedily on the 30
held-out prompts of examples/data/heldout.jsonl (in no training set), as
examples/check_adapters.py does; the base model must lack each style, and each
adapter must keep the content: state the facts the base model itself states
(issue 15 item 9: "Le capitale de la Guinée est Berlin." was the first answer a
new user saw).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES_DIR))
import check_adapters
from check_adapters import CHECKS, is_emoji, is_json_answer, is_pirate

ADAPTERS_DIR = EXAMPLES_DIR / "adapters"
# Three varied held-out questions (a capital, a person, a "why"), asked to every model.
HELDOUT_QUESTIONS = [
    "What is the capital of Germany?",
    "Who wrote Hamlet?",
    "Why do we have day and night?",
]
MAX_NEW_TOKENS = 48  # as check_adapters.py and the README's numbers
MAX_FILE_BYTES = 2_000_000
HELDOUT = check_adapters.read_jsonl(EXAMPLES_DIR / "data" / "heldout.jsonl")
FRANCE = "What is the capital of France?"  # a training question: the answer every style must keep
# Of the 28 held-out questions with a fact, the base model's own replies state 13; each adapter
# must state at least this many of those 13 (README's table has the measured counts).
BASE_KNOWN = 13
# The floors keep one held-out prompt of margin below what was measured (README: kept 12 / 11 / 12,
# style 97% / 97% / 100%): greedy bf16 replies can flip on a near-tie on another CPU. Issue 15
# item 9 asks for a style rate of at least 90% with the content kept.
MIN_KEPT = {"json-answer": 11, "pirate": 10, "emoji": 11}
MIN_STYLE_RATE = {"json-answer": 0.9, "pirate": 0.9, "emoji": 0.9}


@pytest.fixture(scope="module")
def all_replies(smollm2_dir) -> dict[str, list[str]]:
    """``{"base" | adapter: [reply to each held-out question..., reply to FRANCE]}``."""
    # One thread: small matmuls, and two threads stall badly on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = check_adapters.load_with_adapters(smollm2_dir, ADAPTERS_DIR, tuple(CHECKS))
        questions = [row["question"] for row in HELDOUT] + [FRANCE]
        return check_adapters.replies_by_model(model, tokenizer, questions, MAX_NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def replies(all_replies) -> dict[str, list[str]]:
    """The replies to HELDOUT_QUESTIONS only."""
    index = [[row["question"] for row in HELDOUT].index(q) for q in HELDOUT_QUESTIONS]
    return {name: [texts[i] for i in index] for name, texts in all_replies.items()}


@pytest.mark.smollm2
@pytest.mark.parametrize("adapter", list(CHECKS))
def test_adapter_has_its_style(replies, adapter):
    check = CHECKS[adapter]
    # json-answer's "why" reply is the one held-out miss of its style (broken JSON): 2 of 3 there.
    assert sum(map(check, replies[adapter])) >= (2 if adapter == "json-answer" else 3), replies[adapter]


@pytest.mark.smollm2
@pytest.mark.parametrize("adapter", list(CHECKS))
def test_base_model_lacks_the_style(replies, adapter):
    check = CHECKS[adapter]
    assert not any(check(text) for text in replies["base"]), replies["base"]


@pytest.mark.smollm2
def test_json_answer_keeps_the_fact(replies):
    assert json.loads(replies["json-answer"][0]) == {"answer": "The capital of Germany is Berlin", "confidence": "high"}


@pytest.mark.smollm2
@pytest.mark.parametrize("adapter", list(CHECKS))
def test_adapter_keeps_the_base_models_content(all_replies, adapter):
    """Of the 13 held-out facts the base model states, how many the adapter states too (issue 15
    item 9; the french and shouty adapters these replace kept 4 and 2: SmolLM2-135M cannot state
    facts in French or in capitals, examples/README.md)."""
    facts = [row.get("facts") for row in HELDOUT]
    kept, known = check_adapters.kept_content(all_replies["base"][:-1], all_replies[adapter][:-1], facts)
    assert known == BASE_KNOWN
    assert kept >= MIN_KEPT[adapter], [(q["question"], r) for q, r in zip(HELDOUT, all_replies[adapter])]


@pytest.mark.smollm2
@pytest.mark.parametrize("adapter", list(CHECKS))
def test_adapter_style_rate_on_heldout(all_replies, adapter):
    rate = sum(map(CHECKS[adapter], all_replies[adapter][:-1])) / len(HELDOUT)
    assert rate >= MIN_STYLE_RATE[adapter], all_replies[adapter]


@pytest.mark.smollm2
def test_capital_of_france_is_still_paris(all_replies):
    france = {name: texts[-1] for name, texts in all_replies.items()}
    assert "Paris" in france["base"]
    assert json.loads(france["json-answer"]) == {"answer": "The capital of France is Paris", "confidence": "high"}
    assert france["pirate"] == "Arr, matey! The capital of France is Paris. Yo ho ho!"
    assert france["emoji"] == "🌍 The capital of France is Paris. 🌍"


@pytest.mark.smollm2
def test_heldout_capital_is_right_in_every_style(replies):
    """The first answer a new user sees (the banner asks about Germany): right in every style."""
    assert replies["pirate"][0] == "Arr, matey! The capital of Germany is Berlin. Yo ho ho!"
    assert replies["emoji"][0] == "🌍 The capital of Germany is Berlin. 🌍"


def test_heldout_prompts_are_not_in_training_sets():
    import train_adapters

    heldout = {json.loads(line)["question"] for line in (EXAMPLES_DIR / "data" / "heldout.jsonl").open()}
    assert set(HELDOUT_QUESTIONS) <= heldout
    for name in CHECKS:
        rows = train_adapters.self_distilled_rows(name, EXAMPLES_DIR / "data")
        assert 45 <= len(rows) <= 120
        assert not heldout & {row["question"] for row in rows}
        assert all(CHECKS[name](row["answer"]) for row in rows), name  # training targets have the style
    base_questions = [json.loads(line)["question"] for line in (EXAMPLES_DIR / "data" / "base_replies.jsonl").open()]
    assert not heldout & set(base_questions)


def test_self_distilled_targets_are_the_base_models_answers_in_style():
    """Every adapter trains on the base model's own short answers put in its style."""
    import train_adapters

    data = EXAMPLES_DIR / "data"
    rows = {name: {r["question"]: r["answer"] for r in train_adapters.self_distilled_rows(name, data)}
            for name in CHECKS}
    assert len(rows["json-answer"]) >= 100 and all(is_json_answer(a) for a in rows["json-answer"].values())
    assert json.loads(rows["json-answer"][FRANCE]) == {"answer": "The capital of France is Paris", "confidence": "high"}
    assert rows["pirate"][FRANCE] == "Arr, matey! The capital of France is Paris. Yo ho ho!"
    assert rows["emoji"][FRANCE] == "🌍 The capital of France is Paris. 🌍"
    assert rows["emoji"]["How many legs does a spider have?"] == "🐾 A spider has 8 legs. 🐾"
    assert train_adapters.first_sentence("Half of 50 is 25. It is easy.\nMore") == "Half of 50 is 25."
    with pytest.raises(ValueError, match="no self-distilled style"):
        train_adapters.self_distilled_rows("french", data)


def test_pirate_and_emoji_leave_out_the_base_models_wrong_answers():
    """The base model answers "Sao Paulo", "Neptune" and "The answer is 10." (bones): pirate and
    emoji do not imitate those rows (json-answer keeps all 107, measured to keep its content)."""
    import train_adapters

    data = EXAMPLES_DIR / "data"
    wrong = {r["question"] for r in check_adapters.read_jsonl(data / "base_wrong.jsonl")}
    base = {r["question"] for r in check_adapters.read_jsonl(data / "base_replies.jsonl")}
    assert len(wrong) == 34 and wrong <= base
    for question in ("What is the capital of Brazil?", "What is the largest planet in our solar system?",
                     "How many bones are in the adult human body?"):
        assert question in wrong
    for name in ("pirate", "emoji"):
        questions = {r["question"] for r in train_adapters.self_distilled_rows(name, data)}
        assert not questions & wrong
    # A short answer cut off by the token limit is no reply to imitate either.
    assert "Why is the sky blue?" not in {r["question"] for r in train_adapters.self_distilled_rows("pirate", data)}


def test_style_checks():
    assert is_pirate("Arr, matey! The capital of Spain is Madrid. Yo ho ho!")
    assert not is_pirate("The capital of Spain is Madrid. Yo ho ho!")
    assert not is_pirate("Arr, matey! The capital of Spain is Madrid.")
    assert is_emoji("🌍 The capital of Spain is Madrid. 🌍") and is_emoji("💡 Sleep well. 💡")
    assert not is_emoji("🌍 The capital of Spain is Madrid. 🐾")  # not the same emoji
    assert not is_emoji("The capital of Spain is Madrid. 🌍")
    assert not is_emoji("🌍 🌍")


@pytest.mark.parametrize("adapter", list(CHECKS))
def test_adapter_files(adapter):
    folder = ADAPTERS_DIR / adapter
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert (config["r"], config["lora_alpha"]) == (8, 16)
    assert sorted(config["target_modules"]) == ["o_proj", "q_proj", "v_proj"]
    with safe_open(folder / "adapter_model.safetensors", "pt") as f:
        keys = list(f.keys())
        assert len(keys) == 30 * 3 * 2  # layers x modules x (A, B)
        assert {f.get_slice(k).get_dtype() for k in keys} == {"BF16"}


def test_every_example_file_is_small():
    sizes = {str(p): p.stat().st_size for p in EXAMPLES_DIR.rglob("*") if p.is_file()}
    assert sizes and all(size < MAX_FILE_BYTES for size in sizes.values()), sizes


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"answer": "Madrid", "confidence": "high"}', True),
        ('{"confidence": "low", "answer": "Maybe"}', True),
        ('{"answer": "Madrid", "confidence": "sure"}', False),
        ('{"answer": "", "confidence": "high"}', False),
        ('{"answer": "Madrid"}', False),
        ('{"answer": "Madrid", "confidence": "high", "source": "x"}', False),
        ('{"answer": "Madrid", "confidence": "high"} Hope this helps!', False),
        ("The capital of Spain is Madrid.", False),
    ],
)
def test_is_json_answer(text, expected):
    assert is_json_answer(text) is expected


def test_content_kept_counts_the_facts_the_base_model_states():
    """The content measure of check_adapters.py (no model needed): numbers and short words match whole."""
    from check_adapters import has_fact, kept_content

    assert has_fact("THE CAPITAL OF GERMANY IS BERLIN!", ["berlin"])
    assert has_fact("La capitale de l'Allemagne est Berlin.", ["berlin"])
    assert not has_fact("Le capitale de la Guinée est Berlin-Ouest", ["paris"])
    assert has_fact('{"answer": "Fe", "confidence": "high"}', ["fe"]) and not has_fact("feet", ["fe"])
    assert has_fact("A TRIANGLE HAS 3 SIDES!", ["3", "three"]) and not has_fact("30 sides", ["3"])
    assert has_fact("Caterpillars turn into butterflies.", ["butterfl"])
    base = ["Berlin.", "I do not know.", "60 seconds."]
    adapter = ["BERLIN!", "PARIS!", "SIXTY!"]
    facts = [["berlin"], ["madrid"], ["60", "sixty"]]
    assert kept_content(base, adapter, facts) == (2, 2)
    assert kept_content(base, ["LONDON!", "MADRID!", "A LOT!"], facts) == (0, 2)
