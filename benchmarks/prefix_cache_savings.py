"""KV memory with and without prefix caching, counted by the engine's own
block accounting (issue 8). CPU only: it allocates blocks, not tensors.

Each scenario runs ``concurrent`` requests that share a system prompt, each
with 200 user tokens and 200 generated tokens, through a real
:class:`KVCacheManager` (block_size 16), and reports the device blocks held
at the peak, converted to bytes with Llama-2-7B's KV size per token
(2 x 32 layers x 32 heads x 128 dims x 2 bytes = 0.5 MiB). A second run of
200 requests with random lengths measures effective KV utilization:
tokens stored / (blocks allocated x block_size).

Usage: ``python benchmarks/prefix_cache_savings.py`` (prints markdown tables).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loraplex.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from loraplex.engine.sampling_params import SamplingParams  # noqa: E402
from loraplex.engine.sequence import RequestGroup, Sequence  # noqa: E402

KV_BYTES_PER_TOKEN = 2 * 32 * 32 * 128 * 2  # Llama-2-7B, fp16: 0.5 MiB
BLOCK_SIZE = 16
SCENARIOS = [("chat assistant", 500, 20), ("RAG", 2000, 10), ("agent with many tools", 3000, 8),
             ("code assistant", 1000, 30)]


def _sequence(seq_id: int, tokens: list[int]) -> Sequence:
    group = RequestGroup(f"r{seq_id}", None, tokens, SamplingParams(), None, None)
    seq = Sequence(seq_id, group, 0, list(tokens), len(tokens), None, None)
    group.seqs.append(seq)
    return seq


def _compute(kv: KVCacheManager, seq: Sequence, num_tokens: int) -> None:
    """Allocate and 'compute' the next ``num_tokens`` tokens of ``seq``."""
    kv.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    kv.cache_full_blocks(seq)


def run_scenario(system_tokens: int, concurrent: int, caching: bool, user: int = 200, generated: int = 200) -> int:
    """Peak device blocks held while ``concurrent`` requests are all alive."""
    kv = KVCacheManager(num_blocks=200_000, block_size=BLOCK_SIZE, enable_prefix_caching=caching)
    rng = random.Random(0)
    system = [rng.randrange(1, 32000) for _ in range(system_tokens)]
    seqs = []
    for i in range(concurrent):
        seq = _sequence(i, system + [rng.randrange(1, 32000) for _ in range(user)])
        computed = kv.get_computed_blocks(seq)
        kv.allocate_new_computed(seq, computed, seq.num_tokens - computed.num_tokens)
        seq.num_computed_tokens = seq.num_tokens
        kv.cache_full_blocks(seq)
        seqs.append(seq)
    for _ in range(generated):
        for seq in seqs:
            seq.token_ids.append(rng.randrange(1, 32000))
            _compute(kv, seq, 1)
    return kv.pool.stats().used


def utilization(num_requests: int = 200, seed: int = 0) -> tuple[float, int, int]:
    """Effective utilization of a mixed run: requests with random prompt and output lengths."""
    kv = KVCacheManager(num_blocks=400_000, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    rng = random.Random(seed)
    stored = 0
    for i in range(num_requests):
        seq = _sequence(i, [rng.randrange(1, 32000) for _ in range(rng.randint(20, 2000))])
        _compute(kv, seq, seq.num_tokens)
        out = rng.randint(1, 500)
        for _ in range(out):
            seq.token_ids.append(1)
            _compute(kv, seq, 1)
        stored += seq.num_computed_tokens
    blocks = kv.pool.stats().used
    return stored / (blocks * BLOCK_SIZE), stored, blocks


def smollm2_hit_rate(model: str, cache_dir: str | None) -> None:
    """20 requests sharing a 500-token system prompt on the real SmolLM2-135M (CPU)."""
    import time

    from loraplex import LLM

    llm = LLM(model=model, download_dir=cache_dir, max_model_len=1024, max_num_batched_tokens=2048)
    tok = llm.get_tokenizer()
    words = "You are a careful assistant for a hardware store. Answer politely and cite the aisle. "
    system = tok.encode(words * 40)[:500]
    prompts = [{"prompt_token_ids": system + tok.encode(f" Question {i}: where are the size {i} screws?")}
               for i in range(20)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    dt = time.perf_counter() - t0
    stats = llm.engine.get_stats()
    cached = sum(o.num_cached_tokens for o in outs)
    print(f"\nSmolLM2-135M on CPU, 20 requests sharing a 500-token system prompt: prefix cache queries "
          f"{stats.prefix_queries_tokens} tokens, hits {stats.prefix_hits_tokens} tokens "
          f"(hit rate {100 * stats.prefix_hit_rate:.1f}%; {cached} prompt tokens served from cache; "
          f"requests admitted in the first step are cold), {dt:.1f} s")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", action="store_true", help="also run the real SmolLM2 check (CPU)")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()
    rows = []
    for name, system, concurrent in SCENARIOS:
        without = run_scenario(system, concurrent, caching=False) * BLOCK_SIZE * KV_BYTES_PER_TOKEN
        with_ = run_scenario(system, concurrent, caching=True) * BLOCK_SIZE * KV_BYTES_PER_TOKEN
        rows.append(f"| {name} | {system} | {concurrent} | {without / 2**30:.2f} GiB | {with_ / 2**30:.2f} GiB | "
                    f"{100 * (1 - with_ / without):.1f}% |")
    print("| scenario | system prompt tokens | concurrent requests | KV without prefix caching | "
          "KV with prefix caching | saving |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    util, stored, blocks = utilization()
    print(f"\nEffective KV utilization, 200 requests (prompt 20-2000, output 1-500 tokens, block_size "
          f"{BLOCK_SIZE}): {stored} tokens in {blocks} blocks = {100 * util:.2f}%")
    if args.smollm2:
        smollm2_hit_rate("smollm2-135m-instruct", args.cache_dir)


if __name__ == "__main__":
    main()
