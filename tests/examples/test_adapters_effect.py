"""The committed demo adapters (examples/adapters/) change SmolLM2's replies as documented.

Reference: transformers + PEFT load each adapter and generate greedily on
held-out prompts (not in any training set); the base model must lack each style.
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
from check_adapters import CHECKS, is_french, is_json_answer, is_shouty

ADAPTERS_DIR = EXAMPLES_DIR / "adapters"
# Three varied held-out questions (a capital, a person, a "why"), asked to every model.
HELDOUT_QUESTIONS = [
    "What is the capital of Germany?",
    "Who wrote Hamlet?",
    "Why do we have day and night?",
]
MAX_NEW_TOKENS = 40
MAX_FILE_BYTES = 2_000_000


@pytest.fixture(scope="module")
def replies(smollm2_dir) -> dict[str, list[str]]:
    # One thread: small matmuls, and two threads stall badly on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = check_adapters.load_with_adapters(smollm2_dir, ADAPTERS_DIR, tuple(CHECKS))
        return check_adapters.replies_by_model(model, tokenizer, HELDOUT_QUESTIONS, MAX_NEW_TOKENS)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.smollm2
@pytest.mark.parametrize("adapter", list(CHECKS))
def test_adapter_has_its_style(replies, adapter):
    check = CHECKS[adapter]
    assert all(check(text) for text in replies[adapter]), replies[adapter]


@pytest.mark.smollm2
@pytest.mark.parametrize("adapter", list(CHECKS))
def test_base_model_lacks_the_style(replies, adapter):
    check = CHECKS[adapter]
    assert not any(check(text) for text in replies["base"]), replies["base"]


@pytest.mark.smollm2
def test_json_answer_keeps_the_fact(replies):
    assert json.loads(replies["json-answer"][0]) == {"answer": "Berlin", "confidence": "high"}


def test_heldout_prompts_are_not_in_training_sets():
    heldout = {json.loads(line)["question"] for line in (EXAMPLES_DIR / "data" / "heldout.jsonl").open()}
    assert set(HELDOUT_QUESTIONS) <= heldout
    for name in CHECKS:
        rows = [json.loads(line) for line in (EXAMPLES_DIR / "data" / f"{name}.jsonl").open()]
        assert 60 <= len(rows) <= 120
        assert not heldout & {row["question"] for row in rows}
        assert all(CHECKS[name](row["answer"]) for row in rows), name  # training targets have the style


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


@pytest.mark.parametrize(
    "text, expected",
    [
        ("La capitale de l'Espagne est Madrid.", True),
        ("William Shakespeare a écrit Hamlet.", True),  # an accent
        ("Sept fois huit font 56.", True),
        ("A mammal.", False),  # "a" is English too
        ("Madrid.", False),
        ("Le jour et la nuit viennent de la rotation de la Terre.", True),
        ("La capitale de l'Espagne is Madrid.", False),
        ("The capital of Spain is Madrid.", False),
        ("", False),
    ],
)
def test_is_french(text, expected):
    assert is_french(text) is expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("THE CAPITAL OF SPAIN IS MADRID!", True),
        ("THE UNIVERSE IS ABOUT 13.8 BILLION YEARS OLD!", True),
        ("THE CAPITAL OF SPAIN IS MADRID. IT IS BIG!", False),
        ("The capital of Spain is Madrid!", False),
        ("THE CAPITAL OF SPAIN IS MADRID", False),
        ("123!", False),
        ("ONE " * 25 + "WORD!", False),
    ],
)
def test_is_shouty(text, expected):
    assert is_shouty(text) is expected


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
