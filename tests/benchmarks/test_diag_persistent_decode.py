"""benchmarks/diag_persistent_decode.py on the CPU: its stream-K decode attention (the interpreter) against a
float64 softmax over each sequence's gathered K/V."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import diag_persistent_decode as diag  # noqa: E402


def _reference(query, k_cache, v_cache, tables, seq_lens, scale):
    """out[b, hq] = softmax(scale * q . K[:len]) @ V[:len] in float64, K/V of KV head hq // group gathered through
    the block table; zeros for a sequence of no position."""
    num_seqs, heads, dim = query.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(num_seqs, heads, dim, dtype=torch.float64)
    for b, length in enumerate(seq_lens):
        if length == 0:
            continue
        pos = torch.arange(length)
        blk = torch.tensor(tables[b])[pos // page]
        k = k_cache[blk, pos % page].double()  # [len, Hkv, D]
        v = v_cache[blk, pos % page].double()
        for hq in range(heads):
            s = (k[:, hq // (heads // hkv)] @ query[b, hq].double()) * scale
            out[b, hq] = torch.softmax(s, 0) @ v[:, hq // (heads // hkv)]
    return out


CASES = [
    # (seq_lens, KV heads, group, BLOCK_N, programs): every range inside one item, items cut over several ranges,
    # more programs than tiles (empty ranges), sequences of no position, GQA
    ([40, 17, 64], 2, 1, 16, 1),
    ([40, 17, 64], 2, 1, 16, 5),
    ([40, 17, 64], 2, 1, 16, 16),  # 16 tiles: one each
    ([40, 17, 64], 2, 1, 16, 40),  # 24 programs with no tile
    ([33, 0, 90, 1, 0], 2, 4, 16, 7),
    ([200], 1, 4, 32, 3),  # one long item over three ranges
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"lens{'-'.join(map(str, c[0]))}-hkv{c[1]}-g{c[2]}-P{c[4]}")
def test_streamk_decode_matches_the_reference(case, monkeypatch):
    # the workspace NaN (tests/kernels' poison_allocations): a merge reading a slot no program wrote (an empty
    # range's) shows up as NaN, not as the previous launch's partial left in the reused allocation
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    seq_lens, hkv, group, block_n, programs = case
    page, dim = 16, 16
    blocks_per_seq = max(1, -(-max(seq_lens) // page))
    num_seqs = len(seq_lens)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))[::-1] for b in range(num_seqs)]
    k_cache = torch.randn(num_seqs * blocks_per_seq, page, hkv, dim)
    v_cache = torch.randn(num_seqs * blocks_per_seq, page, hkv, dim)
    query = torch.randn(num_seqs, hkv * group, dim)
    counters = torch.zeros(num_seqs * hkv, dtype=torch.int32)
    out = torch.full_like(query, float("nan"))
    expected = _reference(query, k_cache, v_cache, tables, seq_lens, dim ** -0.5)
    for _ in range(2):  # the counters are zero again after a launch
        diag.streamk_decode(query, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
                            torch.tensor(seq_lens, dtype=torch.int32), dim ** -0.5, out, programs, block_n, 1,
                            counters)
        assert counters.count_nonzero().item() == 0
        for b, length in enumerate(seq_lens):
            if length:
                assert (out[b].double() - expected[b]).abs().max().item() < 1e-5, b
            else:  # a sequence of no position is not written
                assert out[b].isnan().all()
