"""Train the three demo LoRA adapters on SmolLM2-135M-Instruct, on CPU.

    python examples/train_adapters.py [--model smollm2] [--only pirate] [--steps 40]

Each adapter learns one visible answer style from the base model's own short answers
(``short_reply`` in ``data/base_replies.jsonl``, first sentence), put in the style by code, so that
it learns a style and no new facts (:func:`self_distilled_rows`):

- ``json-answer``: the reply is strict JSON ``{"answer": "<short answer>", "confidence": "high|medium|low"}``
  (all 107 training questions).
- ``pirate``: ``Arr, matey! <the answer> Yo ho ho!``.
- ``emoji``: the answer between two copies of its topic's emoji: ``🌍 The capital of Japan is Tokyo. 🌍``.

pirate and emoji leave out the 34 questions whose short answer is wrong, garbled or an echo
(``data/base_wrong.jsonl``) and answers cut off mid-sentence.

Inputs use the tokenizer's ChatML chat template (the default system prompt
included, as at inference); the loss covers only the assistant tokens and the
closing ``<|im_end|>``. LoRA (Hu et al. 2021, arXiv:2106.09685) r=8, alpha=16
on q_proj, v_proj, o_proj of all 30 layers: 737,280 parameters, saved in bf16
(1.5 MB) with PEFT ``save_pretrained`` to ``examples/adapters/<name>/``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from loraplex.engine.demo_models import resolve_model
from loraplex.platform.settings import Settings

EXAMPLES_DIR = Path(__file__).resolve().parent
ADAPTER_NAMES = ("json-answer", "pirate", "emoji")
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
IGNORE_INDEX = -100
BASE_REPLIES_FILE = "base_replies.jsonl"
"""The base model's own greedy replies to the training questions (``--make-base-replies``)."""
BASE_WRONG_FILE = "base_wrong.jsonl"
"""Training questions whose ``short_reply`` is wrong, garbled or an echo (judged by hand): pirate and
emoji do not learn from them."""


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters shared by the three adapters.

    - ``rank`` / ``alpha``: LoRA rank and alpha (scaling = alpha / rank).
    - ``target_modules``: projections that get an adapter, in every layer.
    - ``steps``: optimizer steps of ``batch_size`` examples (107 examples: 40 steps = 3 epochs).
    - ``lr``: AdamW peak learning rate, linear warm-up over ``warmup_steps`` then cosine decay to 0.
    """

    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj")
    steps: int = 40
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 4
    seed: int = 0


@dataclass(frozen=True)
class Example:
    """One tokenized chat: ``input_ids [L]``; ``labels [L]`` = IGNORE_INDEX outside the assistant reply."""

    input_ids: list[int]
    labels: list[int]


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


RECIPES = {
    "json-answer": (24, 2e-3),
    "pirate": (24, 2e-3),
    "emoji": (24, 2e-3),
}
"""Adapter -> (steps, peak lr) of the committed adapters (rows: :func:`self_distilled_rows`)."""
SHORT_PROMPT = "Answer in at most five words. "
"""Prefix of the question that asks the base model for its short answer (``short_reply``)."""


def first_sentence(text: str) -> str:
    """The first sentence of the first line of ``text`` (up to and including ``.``, ``!`` or ``?``)."""
    line = text.strip().split("\n")[0]
    match = re.match(r"(.+?[.!?])(?:\s|$)", line)
    return (match.group(1) if match else line).strip()


def self_distilled_rows(name: str, data_dir: Path) -> list[dict]:
    """``{"question", "answer"}`` rows whose answer is the base model's OWN short answer
    (``short_reply`` in ``base_replies.jsonl``, first sentence) put in the adapter's style, so the
    adapter learns the style and keeps the base model's content:
    ``json-answer``: ``{"answer": <that sentence without its final stop>, "confidence": <from
    json-answer.jsonl>}``, every question (right or wrong: measured to keep 12 of 13 held-out facts);
    ``pirate`` / ``emoji``: :func:`pirate_reply` / :func:`emoji_reply` of the sentence, leaving out the
    questions of ``base_wrong.jsonl`` and sentences cut off by the token limit (training on the base
    model's wrong "The answer is 10." rows taught them to state wrong numbers: examples/README.md).

    Rows whose result fails the style's own check are dropped.

    Raises:
        ValueError: ``name`` is not one of ``RECIPES``."""
    from check_adapters import CHECKS  # imports this module: import it late

    confidence = {r["question"]: json.loads(r["answer"])["confidence"]
                  for r in read_jsonl(data_dir / "json-answer.jsonl")}
    wrong = {r["question"] for r in read_jsonl(data_dir / BASE_WRONG_FILE)}
    rows = []
    for base in read_jsonl(data_dir / BASE_REPLIES_FILE):
        sentence = re.sub(r"[.!?]+$", "", first_sentence(base["short_reply"])).strip()
        if name == "json-answer":
            answer = json.dumps({"answer": sentence, "confidence": confidence[base["question"]]}, ensure_ascii=False)
        elif name in ("pirate", "emoji"):
            if base["question"] in wrong:
                continue  # the base model's short answer is wrong or garbled: not a reply to imitate
            short = first_sentence(base["short_reply"])
            if not short or (short[-1:] not in ".!?" and len(short.split()) > 6):
                continue  # empty, or cut off by the 16-token limit: not a reply to imitate
            answer = pirate_reply(short) if name == "pirate" else emoji_reply(base["question"], short)
        else:
            raise ValueError(f"name={name!r}: no self-distilled style")
        if CHECKS[name](answer):
            rows.append({"question": base["question"], "answer": answer})
    return rows


PIRATE_OPENING = "Arr, matey! "
PIRATE_CLOSING = " Yo ho ho!"


def _with_stop(sentence: str) -> str:
    """``sentence`` ending in ``.``, ``!`` or ``?`` (a ``.`` added when it ends otherwise)."""
    return sentence if sentence[-1:] in (".", "!", "?") else sentence + "."


def pirate_reply(sentence: str) -> str:
    """``sentence`` between a pirate's opening and closing: ``Arr, matey! The capital of France is Paris. Yo ho ho!``
    (the sentence itself unchanged: pirate grammar such as "be" for "is" cost held-out facts, examples/README.md)."""
    return PIRATE_OPENING + _with_stop(sentence) + PIRATE_CLOSING


TOPIC_EMOJI = (
    ("🪐", ("planet", "sun", "moon", "star", "solar", "universe", "orbit")),
    ("🌍", ("capital", "country", "continent", "river", "mountain", "ocean", "desert", "language", "currency",
           "earth", "city", "world", "people live")),
    ("🐾", ("animal", "spider", "insect", "bee", "panda", "penguin", "whale", "cat", "wolves", "elephant")),
    ("🍎", ("food", "ingredient", "tofu", "fruit", "bread", "sushi", "banana", "pizza", "breakfast", "coffee", "egg")),
    ("🔢", ("how many", "times", "plus", "square root", "half", "prime", "minutes", "days")),
    ("📜", ("who ", "year", "war", "wall", "invent", "ancient", "wrote", "painted", "composed", "founded")),
    ("🔬", ("gas", "chemical", "temperature", "water", "force", "light", "organ", "body", "vitamin", "material")),
)
"""Topic emoji of a question: the first entry with a keyword in the lower-cased question, else 💡."""
DEFAULT_EMOJI = "💡"
EVERY_EMOJI = frozenset(emoji for emoji, _ in TOPIC_EMOJI) | {DEFAULT_EMOJI}
"""Every emoji an emoji-adapter reply may open and close with."""


def topic_emoji(question: str) -> str:
    text = question.lower()
    return next((emoji for emoji, words in TOPIC_EMOJI if any(w in text for w in words)), DEFAULT_EMOJI)


def emoji_reply(question: str, sentence: str) -> str:
    """``sentence`` framed by the question's topic emoji: ``🌍 The capital of France is Paris. 🌍``."""
    emoji = topic_emoji(question)
    return f"{emoji} {_with_stop(sentence)} {emoji}"


def make_base_replies(model_dir: Path, data_dir: Path) -> Path:
    """Write ``base_replies.jsonl``: per training question the base model's greedy ``reply``
    (64 new tokens) and ``short_reply`` (to ``SHORT_PROMPT + question``, 16 new tokens)
    (transformers, float32, batches of 16 left-padded prompts)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    questions = [r["question"] for r in read_jsonl(data_dir / "json-answer.jsonl")]

    def greedy(texts: list[str], max_new_tokens: int) -> list[str]:
        replies: list[str] = []
        for i in range(0, len(texts), 16):
            prompts = [chat_prompt(tokenizer, q) for q in texts[i : i + 16]]
            batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
            decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            replies += [t.strip() for t in decoded]
        return replies

    replies = greedy(questions, 64)
    short = greedy([SHORT_PROMPT + q for q in questions], 16)
    path = data_dir / BASE_REPLIES_FILE
    with path.open("w", encoding="utf-8") as f:
        for question, reply, short_reply in zip(questions, replies, short):
            row = {"question": question, "reply": reply, "short_reply": short_reply}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def chat_prompt(tokenizer, question: str) -> str:
    """ChatML text of a one-turn user question, ending with the assistant header."""
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def build_example(tokenizer, question: str, answer: str) -> Example:
    """Tokenize prompt + ``answer<|im_end|>``; only the reply and ``<|im_end|>`` carry labels.

    The full text comes from the chat template too, and must start with the
    prompt's tokens (checked), so training sees exactly what inference sends.
    """
    prompt_ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    full_ids = tokenizer(full_text, add_special_tokens=False)["input_ids"]
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(f"question={question!r}: prompt tokens are not a prefix of the chat tokens")
    end = full_ids.index(tokenizer.eos_token_id, len(prompt_ids)) + 1  # keep <|im_end|>, drop the "\n"
    labels = [IGNORE_INDEX] * len(prompt_ids) + full_ids[len(prompt_ids) : end]
    return Example(input_ids=full_ids[:end], labels=labels)


def collate(batch: list[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example: ``input_ids``, ``attention_mask``, ``labels`` all ``[B, L] int64``."""
    length = max(len(e.input_ids) for e in batch)
    pad = [length - len(e.input_ids) for e in batch]
    return {
        "input_ids": torch.tensor([e.input_ids + [pad_token_id] * p for e, p in zip(batch, pad)]),
        "attention_mask": torch.tensor([[1] * len(e.input_ids) + [0] * p for e, p in zip(batch, pad)]),
        "labels": torch.tensor([e.labels + [IGNORE_INDEX] * p for e, p in zip(batch, pad)]),
    }


def reply_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-token cross-entropy over labelled positions.

    Runs the decoder body on all tokens but the LM head only where a label
    follows (~30% of positions), which saves most of the [T, 49152] logits.
    """
    causal_lm = model.get_base_model()
    hidden = causal_lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    logits = causal_lm.lm_head(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warm-up then cosine decay (step counted from 0)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def batches(examples: list[Example], config: TrainConfig):
    """Yield ``config.steps`` batches, reshuffling after each pass over the data."""
    rng = random.Random(config.seed)
    order: list[Example] = []
    for _ in range(config.steps):
        if len(order) < config.batch_size:
            order = order + rng.sample(examples, len(examples))
        yield order[: config.batch_size]
        order = order[config.batch_size :]


def train_adapter(model_dir: Path, name: str, config: TrainConfig, data_dir: Path, out_dir: Path) -> float:
    """Train adapter ``name`` and save it to ``out_dir/name``; returns the wall time in seconds."""
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=list(config.target_modules),
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)
    rows = self_distilled_rows(name, data_dir)
    print(f"{name}: {len(rows)} training questions")
    examples = [build_example(tokenizer, r["question"], r["answer"]) for r in rows]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    model.train()
    for step, batch in enumerate(batches(examples, config)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        loss = reply_loss(model, collate(batch, tokenizer.pad_token_id))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"{name} step {step + 1}/{config.steps} loss {loss.item():.4f} ({time.perf_counter() - start:.0f} s)")
    save_adapter(model, out_dir / name)
    return time.perf_counter() - start


def save_adapter(model, folder: Path) -> None:
    """Save the LoRA weights in bf16 (PEFT format) without PEFT's model-card README.

    Casts the model's LoRA parameters to bf16 in place: call it once training is over.
    """
    for name, param in model.named_parameters():
        if "lora_" in name:
            param.data = param.data.to(torch.bfloat16)
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    model.save_pretrained(folder, save_embedding_layers=False)
    (folder / "README.md").unlink(missing_ok=True)
    # PEFT writes target_modules in set order (string hashes differ per process): sort them, so
    # the same command writes the same bytes.
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="demo model name or HF folder (default: smollm2)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="loraplex cache root holding the demo model "
                        "(default: as the loraplex CLI: LORAPLEX_CACHE_DIR, else ./.cache in a checkout)")
    parser.add_argument("--only", choices=ADAPTER_NAMES, action="append", help="train only these adapters")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the adapter's RECIPES entry)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the adapter's RECIPES entry)")
    parser.add_argument("--make-base-replies", action="store_true",
                        help=f"first write data/{BASE_REPLIES_FILE} (the base model's replies) again")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--data-dir", type=Path, default=EXAMPLES_DIR / "data")
    parser.add_argument("--out-dir", type=Path, default=EXAMPLES_DIR / "adapters")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, args.cache_dir or Settings().cache_dir)
    if args.make_base_replies:
        print(f"wrote {make_base_replies(model_dir, args.data_dir)}")
    for name in args.only or ADAPTER_NAMES:
        steps, lr = RECIPES[name]
        config = TrainConfig(steps=args.steps or steps, lr=args.lr or lr)
        seconds = train_adapter(model_dir, name, config, args.data_dir, args.out_dir)
        size = (args.out_dir / name / "adapter_model.safetensors").stat().st_size
        print(f"{name}: trained in {seconds:.0f} s, adapter_model.safetensors {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
