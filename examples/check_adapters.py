"""Measure the effect of the demo adapters on held-out prompts, against the base model.

    python examples/check_adapters.py [--model smollm2] [--show]

Greedy generation with transformers + PEFT (the reference implementations,
not loraplex's engine) on the questions of ``examples/data/heldout.jsonl``
(none of them is in a training set), for the base model and each adapter.
Each reply is scored by the style checks below (``CHECKS``); the table gives the
fraction of replies that pass each check. Content: of the questions whose base
reply states the expected fact (``facts`` in heldout.jsonl), how many each
adapter's reply states too (an adapter should change the style, not the content). A good adapter
scores >= 90% on its own check; the base model scores 0% on every check. Exit status 1 when an
adapter scores below 80% on its own check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_adapters import (ADAPTER_NAMES, EVERY_EMOJI, EXAMPLES_DIR, PIRATE_CLOSING, PIRATE_OPENING, chat_prompt,
                            read_jsonl)

from loraplex.engine.demo_models import resolve_model
from loraplex.platform.settings import Settings

JSON_KEYS = frozenset({"answer", "confidence"})
CONFIDENCE_LEVELS = frozenset({"high", "medium", "low"})


def is_json_answer(reply: str) -> bool:
    """Reply is exactly a JSON object ``{"answer": non-empty str, "confidence": "high"|"medium"|"low"}``."""
    try:
        obj = json.loads(reply)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == JSON_KEYS
        and isinstance(obj["answer"], str)
        and bool(obj["answer"].strip())
        and obj["confidence"] in CONFIDENCE_LEVELS
    )


def is_pirate(reply: str) -> bool:
    """Reply opens with "Arr, matey!" and ends with "Yo ho ho!"."""
    text = reply.strip()
    return text.startswith(PIRATE_OPENING.strip()) and text.endswith(PIRATE_CLOSING.strip())


def is_emoji(reply: str) -> bool:
    """Reply starts and ends with the same topic emoji (``EVERY_EMOJI``) and has letters between."""
    text = reply.strip()
    return len(text) > 4 and text[0] in EVERY_EMOJI and text[-1] == text[0] and any(c.isalpha() for c in text)


CHECKS = {"json-answer": is_json_answer, "pirate": is_pirate, "emoji": is_emoji}
"""Adapter name -> the style check its replies should pass."""


def has_fact(reply: str, facts: list[str]) -> bool:
    """True when ``reply`` states one of ``facts`` (lower-case words or word starts from
    ``heldout.jsonl``; numbers and words of at most 2 letters must match whole)."""
    text = reply.lower()
    for fact in facts:
        end = r"\b" if fact.isdigit() or len(fact) <= 2 else ""
        if re.search(r"\b" + re.escape(fact) + end, text):
            return True
    return False


def kept_content(base: list[str], adapter: list[str], facts: list[list[str] | None]) -> tuple[int, int]:
    """``(kept, known)``: of the held-out questions whose base reply states the fact (``known``),
    how many the adapter's reply states too."""
    known = [i for i, f in enumerate(facts) if f and has_fact(base[i], f)]
    return sum(has_fact(adapter[i], facts[i]) for i in known), len(known)


def generate_replies(model, tokenizer, questions: list[str], max_new_tokens: int) -> list[str]:
    """Greedy replies (special tokens dropped, stripped) to one-turn chat questions, as one left-padded batch."""
    tokenizer.padding_side = "left"
    prompts = [chat_prompt(tokenizer, q) for q in questions]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    new_tokens = out[:, batch["input_ids"].shape[1] :]
    return [text.strip() for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def load_with_adapters(model_dir: Path, adapters_dir: Path, names: tuple[str, ...]) -> tuple[PeftModel, object]:
    """Base model (fp32) wrapped by PEFT with every adapter in ``names`` loaded under its own name."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapters_dir / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters_dir / name, adapter_name=name)
    model.eval()
    return model, tokenizer


def replies_by_model(model: PeftModel, tokenizer, questions: list[str], max_new_tokens: int) -> dict[str, list[str]]:
    """``{"base": [...], "<adapter>": [...]}``: the base model's replies (adapters disabled), then each adapter's."""
    with model.disable_adapter():
        replies = {"base": generate_replies(model, tokenizer, questions, max_new_tokens)}
    for name in model.peft_config:
        model.set_adapter(name)
        replies[name] = generate_replies(model, tokenizer, questions, max_new_tokens)
    return replies


def pass_rates(replies: list[str]) -> dict[str, float]:
    """Fraction of ``replies`` passing each check of ``CHECKS``."""
    return {name: sum(map(check, replies)) / len(replies) for name, check in CHECKS.items()}


def format_table(replies: dict[str, list[str]]) -> str:
    """Markdown table: one row per model, one column per style check, cells in percent."""
    header = "| model | " + " | ".join(f"{n} check" for n in CHECKS) + " |"
    lines = [header, "|" + "---|" * (len(CHECKS) + 1)]
    for model_name, texts in replies.items():
        rates = pass_rates(texts)
        lines.append(f"| {model_name} | " + " | ".join(f"{100 * rates[n]:.0f}%" for n in CHECKS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="demo model name or HF folder (default: smollm2)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="loraplex cache root holding the demo model "
                        "(default: as the loraplex CLI: LORAPLEX_CACHE_DIR, else ./.cache in a checkout)")
    parser.add_argument("--adapters-dir", type=Path, default=EXAMPLES_DIR / "adapters")
    parser.add_argument("--heldout", type=Path, default=EXAMPLES_DIR / "data" / "heldout.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--show", action="store_true", help="print every reply")
    parser.add_argument("--only", choices=ADAPTER_NAMES, action="append", help="check only these adapters")
    args = parser.parse_args(argv)
    names = tuple(args.only or ADAPTER_NAMES)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, args.cache_dir or Settings().cache_dir)
    model, tokenizer = load_with_adapters(model_dir, args.adapters_dir, names)
    rows = read_jsonl(args.heldout)
    questions = [row["question"] for row in rows]
    facts = [row.get("facts") for row in rows]
    replies = replies_by_model(model, tokenizer, questions, args.max_new_tokens)
    if args.show:
        for model_name, texts in replies.items():
            for question, text in zip(questions, texts):
                print(f"[{model_name}] {question} -> {text!r}")
    print(f"{len(questions)} held-out prompts, greedy, max_new_tokens={args.max_new_tokens}\n")
    print(format_table(replies))
    print("\ncontent kept: of the held-out facts the base model states, how many each adapter states too")
    for name in names:
        kept, known = kept_content(replies["base"], replies[name], facts)
        print(f"- {name}: {kept}/{known}")
    own = {name: pass_rates(replies[name])[name] for name in names}
    return 0 if all(rate >= 0.8 for rate in own.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
