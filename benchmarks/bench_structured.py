"""Structured-output throughput (issue 20): batch-32 decoding with every request constrained by
a moderately complex JSON schema against the same batch unconstrained, Llama-2-7B shapes,
random bf16 weights, offline engine.

The model folder gets a Llama-2-style byte-fallback vocabulary (``<0x00>``..``<0xFF>`` plus
32000 - 259 ``▁``-prefixed and bare pieces of letters, digits and JSON punctuation), so xgrammar
sees a vocabulary like Llama-2's (random weights need no real tokenizer, a grammar does).
The schema (:data:`ORDER_SCHEMA`: nested objects, enums, a pattern, ``$ref``, an array with
``minItems`` 64) has no valid output shorter than ``--out-len`` tokens, so every constrained
sequence runs to ``max_tokens`` as the unconstrained ones do with ``ignore_eos``: both runs
generate the same token count. Reported: output tokens/s of each (median of ``--repeat``),
their ratio (goal >= 0.90), and the mask worker's fill time and the engine thread's wait for
it per step (the part of the mask work not overlapped with the forward pass).

Usage (GPU): ``python benchmarks/bench_structured.py --out $OUT/structured.json``
CPU smoke test: ``python benchmarks/bench_structured.py --tiny --out /tmp/structured.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import LLAMA2_7B, git_commit, print_table  # noqa: E402

from loraplex import LLM, SamplingParams  # noqa: E402
from loraplex.engine.structured_output import StructuredOutputsParams  # noqa: E402

TINY = dict(LLAMA2_7B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, torch_dtype="float32")

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "maxLength": 32},
            "tier": {"enum": ["free", "pro", "enterprise"]}}, "required": ["name", "email", "tier"]},
        "items": {"type": "array", "minItems": 64, "items": {"$ref": "#/$defs/item"}},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "notes": {"type": ["string", "null"], "maxLength": 40},
    },
    "required": ["order_id", "customer", "items", "status"],
    "$defs": {"item": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number", "minimum": 0},
        "gift": {"type": "boolean"}}, "required": ["sku", "quantity", "price", "gift"]}},
}


def byte_fallback_vocab(vocab_size: int) -> list[str]:
    """Llama-2-style pieces: specials, 256 byte tokens, then printable characters and
    ``▁``-prefixed / bare letter, digit and JSON-punctuation pieces, ``vocab_size`` in all."""
    vocab = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    seen = set(vocab)
    punct = ['{"', '"}', '",', '":', '": "', '", "', '["', '"]', '},', '}]', '[{', '{', '}', '[', ']', ',', ':',
             '"', '": ', ', ', 'true', 'false', 'null', '-', '.', '@', '_']
    letters = string.ascii_lowercase
    pieces = itertools.chain(
        (c for c in string.printable if c not in "\t\n\r\x0b\x0c "), punct, ["▁"],
        (f"{d}" for d in range(100)), (f"{d:03d}" for d in range(1000)),
        ("▁" + "".join(p) for p in itertools.product(letters, repeat=2)),
        ("".join(p) for p in itertools.product(letters, repeat=2)),
        ("▁" + "".join(p).capitalize() for p in itertools.product(letters, repeat=3)),
        ("".join(p) for p in itertools.product(letters, repeat=3)),
        ("▁" + "".join(p) for p in itertools.product(letters, repeat=3)),
        ("".join(p).upper() for p in itertools.product(letters, repeat=3)),
        ("".join(p) for p in itertools.product(letters, repeat=4)))
    for piece in pieces:
        if len(vocab) == vocab_size:
            break
        if piece not in seen:
            seen.add(piece)
            vocab.append(piece)
    return vocab


def make_model_dir(path: Path, config: dict) -> Path:
    """``config.json`` and a fast tokenizer with :func:`byte_fallback_vocab` and Llama-2's decoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    vocab = {piece: i for i, piece in enumerate(byte_fallback_vocab(config["vocab_size"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return path


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_batch(llm: LLM, prompts: list[list[int]], out_len: int, constrained: bool) -> dict:
    """Add the batch, step to the end; output tokens/s and (constrained) how each finished."""
    engine = llm.engine
    if constrained:
        params = SamplingParams(temperature=0.0, max_tokens=out_len, output_kind="final_only",
                                structured_outputs=StructuredOutputsParams(json=ORDER_SCHEMA))
    else:
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="final_only")
    masks = engine.runner.grammar_masks
    fill0, wait0, num0 = masks.fill_s, masks.wait_s, masks.num_masks
    _sync()
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params)
    finals, steps = [], 0
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
        steps += 1
    _sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in finals)
    num_masks = masks.num_masks - num0
    return {"total_s": dt, "output_tokens": tokens, "output_tokens_per_s": tokens / dt, "steps": steps,
            "finished_by_length": sum(o.outputs[0].finish_reason == "length" for o in finals),
            "mask_steps": num_masks, "first_text": finals[0].outputs[0].text if finals else "",
            "mask_fill_ms_per_step": 1e3 * (masks.fill_s - fill0) / max(num_masks, 1),
            "mask_wait_ms_per_step": 1e3 * (masks.wait_s - wait0) / max(num_masks, 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON result file")
    ap.add_argument("--tiny", action="store_true", help="tiny random model on CPU (tests the script)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--in-len", type=int, default=128)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    config = TINY if args.tiny else LLAMA2_7B
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "model", config)
        engine_args = dict(dummy_weights=True, max_model_len=args.in_len + args.out_len + 8,
                           max_num_seqs=max(args.batch, 8), max_num_batched_tokens=max(2048, args.in_len * 2))
        if args.tiny:
            engine_args.update(dtype="float32", num_kv_blocks=args.batch * (args.in_len + args.out_len) // 16 + 64)
        else:
            engine_args.update(dtype="bfloat16", gpu_memory_utilization=0.85)
        llm = LLM(str(model_dir), **engine_args)
        t0 = time.perf_counter()
        llm.engine.structured_outputs.compile(StructuredOutputsParams(json=ORDER_SCHEMA))
        compile_s = time.perf_counter() - t0
        prompts = [[rng.randrange(300, config["vocab_size"]) for _ in range(args.in_len)] for _ in range(args.batch)]
        warm = max(4, args.out_len // 8)
        run_batch(llm, prompts, warm, False)  # warm-up: kernels, graphs, matchers (not measured)
        run_batch(llm, prompts, warm, True)
        runs: dict[str, list[dict]] = {"unconstrained": [], "json_schema": []}
        for _ in range(args.repeat):
            runs["unconstrained"].append(run_batch(llm, prompts, args.out_len, False))
            runs["json_schema"].append(run_batch(llm, prompts, args.out_len, True))
    median = {k: statistics.median(r["output_tokens_per_s"] for r in v) for k, v in runs.items()}
    result = {"commit": git_commit(), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": "tiny" if args.tiny else "llama-2-7b shapes, random bf16", "batch": args.batch,
              "in_len": args.in_len, "out_len": args.out_len, "schema_compile_s": compile_s,
              "output_tokens_per_s": median, "ratio": median["json_schema"] / median["unconstrained"], "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    last = runs["json_schema"][-1]
    print_table(f"Structured output, batch {args.batch}, {args.in_len} in / {args.out_len} out ({result['device']})",
                ["run", "output tok/s", "ratio", "finished by length", "mask fill ms/step", "mask wait ms/step"],
                [["unconstrained", f"{median['unconstrained']:.0f}", "1.00", "-", "-", "-"],
                 [f"JSON schema (all {args.batch})", f"{median['json_schema']:.0f}", f"{result['ratio']:.3f}",
                  f"{last['finished_by_length']}/{args.batch}", f"{last['mask_fill_ms_per_step']:.2f}",
                  f"{last['mask_wait_ms_per_step']:.2f}"]])
    return result


if __name__ == "__main__":
    main()
