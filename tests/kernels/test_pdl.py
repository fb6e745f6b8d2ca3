"""Programmatic dependent launches (``_triton.pdl_args`` / ``pdl_wait``): chosen on Hopper CUDA devices only, and
on the GPU a chain of dependent kernels gives the same bits with and without them, eager and in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import _triton
from loraplex.kernels._triton import (PDL_TRIGGERS, pdl_args, pdl_kv_prefetch_positions, pdl_launches,
                                      pdl_prefetch_columns, use_pdl, use_pdl_kv_prefetch, use_pdl_prefetch,
                                      use_pdl_trigger)


def test_pdl_only_on_hopper_cuda(monkeypatch):
    assert pdl_args(torch.device("cpu"), "rms_norm") == {"USE_PDL": False}
    monkeypatch.setattr(_triton, "_cuda_capability_major", lambda index: 9)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda", 0)
    assert pdl_args(cuda, "rms_norm") == {"USE_PDL": False}, "outside pdl_launches()"
    with pdl_launches():
        # the default triggers: GEMMs and decode attention late (3), every other kernel at its start (1)
        assert pdl_args(cuda, "rms_norm") == {"USE_PDL": 1, "launch_pdl": True}
        assert {op: pdl_args(cuda, op)["USE_PDL"] for op in ("dense_linear", "fp8_linear", "paged_decode_attention",
                                                                "rotary_and_cache", "silu_and_mul", "fused_lora")} == {
            "dense_linear": 3, "fp8_linear": 3, "paged_decode_attention": 3, "rotary_and_cache": 1, "silu_and_mul": 1,
            "fused_lora": 1}
        with pdl_launches(False):
            assert pdl_args(cuda, "rms_norm") == {"USE_PDL": False}
        previous = use_pdl(False)
        try:
            assert previous is True and pdl_args(cuda, "rms_norm") == {"USE_PDL": False}
            use_pdl(frozenset({"rms_norm"}))
            assert pdl_args(cuda, "rms_norm")["USE_PDL"] and not pdl_args(cuda, "dense_linear")["USE_PDL"]
        finally:
            use_pdl(previous)
        monkeypatch.setattr(_triton, "_cuda_capability_major", lambda index: 8)
        assert pdl_args(cuda, "rms_norm") == {"USE_PDL": False}


def test_trigger_modes_and_prefetch_columns(monkeypatch):
    monkeypatch.setattr(_triton, "_cuda_capability_major", lambda index: 9)
    cuda = torch.device("cuda", 0)
    previous = use_pdl_trigger({"dense_linear": "late"})
    try:
        with pdl_launches():
            assert pdl_args(cuda, "dense_linear") == {"USE_PDL": PDL_TRIGGERS["late"], "launch_pdl": True} == {
                "USE_PDL": 3, "launch_pdl": True}
            assert pdl_args(cuda, "rms_norm")["USE_PDL"] == 1  # ops not named: "start"
            use_pdl_trigger("exit")
            assert pdl_args(cuda, "rms_norm")["USE_PDL"] == 2
        with pytest.raises(ValueError, match="late.*start"):
            use_pdl_trigger("early")
        with pytest.raises(ValueError, match="late"):
            use_pdl_trigger({"rms_norm": "soon"})
    finally:
        use_pdl_trigger(previous)
    assert pdl_prefetch_columns(1, 4096) == 0  # off by default
    before = use_pdl_prefetch(1024)
    try:
        assert before == 0
        assert pdl_prefetch_columns(1, 4096) == 1024
        assert pdl_prefetch_columns(1, 640) == 512  # capped at the power of two at or below K
        assert pdl_prefetch_columns(False, 4096) == 0  # only launches that use PDL prefetch before their wait
        assert pdl_prefetch_columns(3, 32) == 0
        for bad in (32, 96, -64):
            with pytest.raises(ValueError, match="power of two"):
                use_pdl_prefetch(bad)
    finally:
        use_pdl_prefetch(before)


def _chain(kernels, h, weights, g):
    """A decode layer's dependent kernels, eight times over: each reads what the one before wrote."""
    residual = h
    for w_up, w_down in weights:
        x, residual = kernels.rms_norm(h, g, 1e-5, residual)
        up = kernels.dense_linear(x, w_up, config=("swap", 16, 64, 64, 4, 3))
        h = kernels.dense_linear(kernels.silu_and_mul(up), w_down, config=("gemv", 1, 8, 256, 4, 3))
    return h, residual


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("trigger,prefetch", [("start", 0), ("exit", 0), ("late", 0), ("start", 512), ("late", 1024)])
def test_dependent_chain_is_bitwise_the_same_with_and_without_pdl(trigger, prefetch):
    from loraplex.kernels.ops import Kernels

    kernels = Kernels("triton")
    torch.manual_seed(0)
    hidden, inter = 1024, 2816
    weights = [((torch.randn(2 * inter, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16),
                (torch.randn(hidden, inter, device="cuda") / inter**0.5).to(torch.bfloat16)) for _ in range(8)]
    g = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(torch.bfloat16)
    h = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    results = {}
    previous = use_pdl_trigger(trigger), use_pdl_prefetch(prefetch)
    try:
        for pdl in (False, True):
            with pdl_launches(pdl):
                eager = _chain(kernels, h, weights, g)
                graph, static_h = torch.cuda.CUDAGraph(), h.clone()
                _chain(kernels, static_h, weights, g)  # compiled before capture
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    captured = _chain(kernels, static_h, weights, g)
                outs = []
                for _ in range(20):
                    static_h.copy_(torch.randn_like(h))
                    graph.replay()
                    outs.append((static_h.clone(), captured[0].clone()))
                torch.cuda.synchronize()
                expected = [_chain(kernels, x, weights, g)[0] for x, _ in outs]
                results[pdl] = eager
                for (_, got), want in zip(outs, expected):
                    assert torch.equal(got, want)
    finally:
        use_pdl_trigger(previous[0])
        use_pdl_prefetch(previous[1])
    assert all(torch.equal(a, b) for a, b in zip(results[False], results[True]))


def test_kv_prefetch_positions():
    assert pdl_kv_prefetch_positions(3) == 0  # off by default (measured no faster in the engine)
    before = use_pdl_kv_prefetch(32)
    try:
        assert before == 0
        assert pdl_kv_prefetch_positions(3) == 32 and pdl_kv_prefetch_positions(1) == 32
        assert pdl_kv_prefetch_positions(False) == 0  # only launches that use PDL read ahead of their wait
        for bad in (8, 48, -16):
            with pytest.raises(ValueError, match="power of two"):
                use_pdl_kv_prefetch(bad)
    finally:
        use_pdl_kv_prefetch(before)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("kv_prefetch,trigger", [(64, "late"), (16, "start")])
def test_decode_attention_prefetching_kv_sees_the_token_written_before_it(kv_prefetch, trigger):
    """In a graph, a cache write (the step's new token) then decode attention, with the attention's K/V prefetched
    before its PDL wait: every replay's output equals the attention without PDL of the same caches, also where the
    new position lies inside the prefetched positions (contexts 1..48 with 64 prefetched), and the float32
    reference within bf16 rounding."""
    from loraplex.kernels.attention import paged_attention_ref
    from loraplex.kernels.attention_metadata import AttentionMetadata
    from loraplex.kernels.ops import Kernels

    kernels = Kernels("triton")
    torch.manual_seed(0)
    heads, d, bs, batch = 8, 128, 16, 6
    ctx = [1, 17, 48, 64, 200, 700]
    per_seq = 48
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    k_cache = torch.randn(1 + batch * per_seq, bs, heads, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    meta = AttentionMetadata.build([1] * batch, ctx, tables, bs, "cuda")
    q, k_new, v_new = (torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def step():
        kernels.reshape_and_cache(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
        return kernels.paged_attention(q, k_cache, v_cache, meta, d**-0.5)

    previous = use_pdl_kv_prefetch(kv_prefetch), use_pdl_trigger(trigger)
    try:
        with pdl_launches(True):
            step()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
        for _ in range(10):
            for t in (q, k_new, v_new):
                t.copy_(torch.randn_like(t))
            graph.replay()
            got = out.clone()
            with pdl_launches(False):
                want = step()
            torch.cuda.synchronize()
            assert torch.equal(got, want)
            ref = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, d**-0.5)
            torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
    finally:
        use_pdl_kv_prefetch(previous[0])
        use_pdl_trigger(previous[1])
