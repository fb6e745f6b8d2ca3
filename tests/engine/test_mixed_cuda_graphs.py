"""CUDA graphs for mixed steps (decode rows + prompt chunks), emulated on the CPU (issue 16).

The graph runner's static buffers are filled as on a GPU and a stand-in "replay" runs the model on exactly
what a replay reads: the padded token rows, and the query offsets of the graph's sequence count, whose
padding sequences must be empty. Every request then equals the eager engine (tokens, logprobs) with chunked
prompts next to running decodes, LoRA and base rows mixed, a fork and seeded sampling; plus the bucket
arithmetic (token buckets, sequences per bucket, capture shapes).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_step_fastpaths import VARIANTS, _EagerReplay, _requests, _run
from tiny_models import make_peft_adapter

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine.cuda_graphs import CudaGraphRunner, _Graph, capture_query_lens, default_mixed_sizes
from loraplex.engine.models.llama import LoRABatch
from loraplex.kernels import attention_decode
from loraplex.kernels.attention_metadata import AttentionMetadata


def test_token_buckets_and_capture_shapes():
    assert default_mixed_sizes(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert default_mixed_sizes(24) == [16, 24]
    assert default_mixed_sizes(600) == [16, 32, 64, 128, 256, 512, 600]
    assert default_mixed_sizes(2) == []
    # Both kernels captured: some prefill rows (no longer than max_len), the last row a decode.
    assert capture_query_lens(16, 8, 64) == [9, 1, 1, 1, 1, 1, 1, 1]
    assert capture_query_lens(2048, 255, 1024) == [1024, 1024 - 255 + 2] + [1] * 253
    assert sum(capture_query_lens(2048, 255, 1024)) == 2048
    assert capture_query_lens(40, 3, 16) is None  # 3 sequences of at most 16 tokens cannot hold 40
    assert capture_query_lens(8, 8, 64) is None and capture_query_lens(8, 1, 64) is None


def test_mixed_bucket_choice(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), max_model_len=64, block_size=4, num_kv_blocks=64, max_num_seqs=8)
    engine = llm.engine
    graphs = CudaGraphRunner(engine.model, engine.kv_cache.layers, 4, 64, 8, 0, engine.device,
                             max_num_batched_tokens=40)
    assert graphs.sizes == [1, 2, 4, 8] and graphs.mixed_sizes == [16, 32, 40]
    assert [graphs.mixed_num_seqs(t) for t in graphs.mixed_sizes] == [8, 8, 8]
    assert graphs.mixed_padded_size(16, 8) == 16 and graphs.mixed_padded_size(17, 2) == 32
    assert graphs.mixed_padded_size(40, 1) == 40 and graphs.mixed_padded_size(41, 1) is None
    assert graphs.mixed_padded_size(9, 9) is None  # more sequences than a graph holds
    assert graphs.input_ids.shape == (40,) and graphs.block_tables.shape == (8, 16)
    no_mixed = CudaGraphRunner(engine.model, engine.kv_cache.layers, 4, 64, 8, 0, engine.device)
    assert no_mixed.mixed_sizes == [] and no_mixed.mixed_padded_size(5, 2) is None


class _EagerMixedReplay(_EagerReplay):
    """A mixed graph's stand-in: checks the padding the runner wrote (empty trailing sequences, padding
    tokens with slot -1, id 0, position 0, no adapter), then runs the model over all ``size`` token rows
    with the real sequences' metadata (the reference attention needs host lists of real sequences; the
    Triton kernels' handling of empty sequences is tested in tests/kernels)."""

    def replay(self) -> None:
        g, n = self.graphs, self.size
        num_seqs = g.mixed_num_seqs(n)
        qsl = g.mixed_query_start_loc[:num_seqs + 1].tolist()
        q_lens = [qsl[i + 1] - qsl[i] for i in range(num_seqs)]
        b = sum(1 for q in q_lens if q > 0)
        t = qsl[-1]
        assert all(q > 0 for q in q_lens[:b]) and all(q == 0 for q in q_lens[b:]), "padding sequences trail"
        assert g.slot_mapping[t:n].eq(-1).all() and g.input_ids[t:n].eq(0).all() and g.positions[t:n].eq(0).all()
        if self.with_lora:
            assert g.token_slots[t:n].eq(-1).all()
        seq_lens = g.seq_lens[:b].tolist()
        meta = AttentionMetadata(query_start_loc=g.mixed_query_start_loc[:b + 1], seq_lens=g.seq_lens[:b],
                                 block_tables=g.block_tables[:b], slot_mapping=g.slot_mapping[:n],
                                 max_query_len=max(q_lens), max_seq_len=max(seq_lens),
                                 query_start_loc_host=qsl[:b + 1], seq_lens_host=seq_lens)
        lora = LoRABatch(self._checked_mapping(), dora=self.with_dora) if self.with_lora else None
        with torch.inference_mode():
            self.hidden.copy_(g.model(g.input_ids[:n], g.positions[:n], g.kv_layers, meta, lora))
        self.replays += 1
        self.shapes.append((t, b, n))


def _emulate(llm: LLM) -> tuple[list[_EagerReplay], list[_EagerMixedReplay]]:
    engine = llm.engine
    graphs = CudaGraphRunner(engine.model, engine.kv_cache.layers, engine.config.block_size, engine.max_model_len,
                             engine.config.max_num_seqs, engine.config.max_loras, engine.device,
                             engine.config.max_num_batched_tokens)
    decode, mixed = [], []
    for sizes, contexts, table, cls, out in (
            (graphs.sizes, graphs.context_buckets, graphs.graphs, _EagerReplay, decode),
            (graphs.mixed_sizes, (None,), graphs.mixed_graphs, _EagerMixedReplay, mixed)):
        for size, (with_lora, with_dora), context in itertools.product(sizes, VARIANTS, contexts):
            hidden = torch.full((size, engine.spec.hidden_size), float("nan"), device=engine.device,
                                dtype=engine.dtype)
            replay = cls(graphs, size, with_lora, hidden, with_dora, context or 0)
            replay.shapes = []
            key = (size, with_lora, with_dora) if context is None else (size, with_lora, with_dora, context)
            table[key] = _Graph(replay, hidden)
            out.append(replay)
    engine.runner.graphs = graphs
    return decode, mixed


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("mixed-graph-adapters")
    return [LoRARequest(name, i + 1, str(make_peft_adapter(tiny_llama_dir, root / name, r=8, seed=40 + i,
                                                            targets=("q_proj", "v_proj", "down_proj"))))
            for i, name in enumerate(("x", "y"))]


def test_mixed_graph_steps_equal_eager_steps(tiny_llama_dir, adapters):
    # A 20-token step budget (mixed buckets 16 and 20): the 7 prompts (1..14 tokens, one n=2 fork) are
    # chunked and admitted next to running decodes, so the early steps mix prompt chunks with decode rows.
    kw = {"model": str(tiny_llama_dir), "max_model_len": 64, "block_size": 4, "num_kv_blocks": 256,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_seqs": 8,
          "max_num_batched_tokens": 20}
    prompts, params, loras = _requests(tiny_llama_dir, adapters)
    expected = _run(LLM(**kw), prompts, params, loras)
    graph_llm = LLM(**kw)
    decode, mixed = _emulate(graph_llm)
    got = _run(graph_llm, prompts, params, loras)
    shapes = [s for r in mixed for s in r.shapes]
    assert len(shapes) >= 3, "steps with prompt tokens replayed mixed graphs"
    assert any(t > b > 1 for t, b, _ in shapes), "a replay mixed a prompt chunk with other rows"
    assert any(t < size for t, _, size in shapes), "a replay padded tokens (and sequences) to its bucket"
    assert sum(r.replays for r in mixed if r.with_lora) > 0 and sum(r.replays for r in decode) > 10
    assert {r.size for r in mixed if r.replays} <= {16, 20}
    for exp_req, got_req in zip(expected, got):
        for (e_ids, e_cum, e_lp, e_fin), (g_ids, g_cum, g_lp, g_fin) in zip(exp_req, got_req):
            assert g_ids == e_ids and g_fin == e_fin
            assert g_cum == pytest.approx(e_cum, abs=1e-4)
            if e_lp is not None:
                for e_pos, g_pos in zip(e_lp, g_lp):
                    assert list(g_pos) == list(e_pos)
                    assert list(g_pos.values()) == pytest.approx(list(e_pos.values()), abs=1e-4)


def _overlappable_requests(adapters):
    """Only rows whose steps can overlap (no logprobs, penalties or forks); prompts long enough to be chunked
    next to the decodes of the requests admitted before them."""
    rng = torch.Generator().manual_seed(8)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=rng).tolist()}
               for n in (5, 9, 3, 14, 30, 7, 25, 11)]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=m, temperature=0.9, seed=i, ignore_eos=True)
              for i, m in enumerate((20, 12, 18, 9, 10, 16, 8, 14))]
    loras = [None, adapters[0], adapters[1], None, adapters[0], adapters[1], None, adapters[0]]
    return prompts, params, loras


def test_async_mixed_steps_replay_graphs_with_placeholders_from_the_device(tiny_llama_dir, adapters):
    """Async scheduling: a step carrying a prompt chunk next to decode rows whose input token is still a
    placeholder (sampled by the step in flight) replays a mixed graph, each placeholder written from the
    previous step's device samples after the upload. Until session 8 such steps ran eagerly (on an H200
    behind the REST API: median time to first token 172 instead of 28 ms). Tokens equal the sync engine's."""
    kw = {"model": str(tiny_llama_dir), "max_model_len": 64, "block_size": 4, "num_kv_blocks": 256,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_seqs": 8,
          "max_num_batched_tokens": 20}
    prompts, params, loras = _overlappable_requests(adapters)
    expected = _run(LLM(**kw), prompts, params, loras)
    llm = LLM(**kw, async_scheduling=True)
    _, mixed = _emulate(llm)
    graphs = llm.engine.runner.graphs
    fixed_rows = []
    run_mixed = graphs.run_mixed

    def counting_run_mixed(*args, **kwargs):
        fix = kwargs.get("input_fix")
        fixed_rows.append(0 if fix is None else int(torch.as_tensor(fix[1]).numel()))
        return run_mixed(*args, **kwargs)

    graphs.run_mixed = counting_run_mixed
    got = _run(llm, prompts, params, loras)
    assert llm.engine.num_overlapped_steps > 0
    assert sum(r.replays for r in mixed) == len(fixed_rows) >= 3
    assert sum(1 for n in fixed_rows if n > 0) >= 2, "mixed replays took placeholder tokens from the device"
    for exp_req, got_req in zip(expected, got):
        for (e_ids, e_cum, e_lp, e_fin), (g_ids, g_cum, g_lp, g_fin) in zip(exp_req, got_req):
            assert g_ids == e_ids and g_fin == e_fin
            assert g_cum == pytest.approx(e_cum, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("three_stages_from", [None, 20])
def test_captured_mixed_graphs_equal_eager_on_gpu(tiny_llama_dir, adapters, monkeypatch, three_stages_from):
    """On a GPU, float32: captured decode and mixed-step graphs (Triton kernels, empty padding sequences
    read by the real attention kernels) give the eager engine's tokens and logprobs; with decode attention
    configs that change at 20 positions, decode steps replay the graphs of both context buckets (2 and 3
    pipeline stages)."""
    if three_stages_from is not None:
        monkeypatch.setattr(attention_decode, "THREE_STAGES_FROM", three_stages_from)
    kw = {"model": str(tiny_llama_dir), "device": "cuda", "dtype": "float32", "max_model_len": 64,
          "block_size": 4, "num_kv_blocks": 256, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
          "max_num_seqs": 8, "max_num_batched_tokens": 20}
    prompts, params, loras = _requests(tiny_llama_dir, adapters)
    expected = _run(LLM(**kw, enforce_eager=True), prompts, params, loras)
    llm = LLM(**kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and set(graphs.mixed_graphs) == {(t, lora, dora) for t in (16, 20)
                                                           for lora, dora in VARIANTS}
    assert graphs.context_buckets == ((19, 64) if three_stages_from else (64,))
    calls, longest = [], []
    run_mixed, run = graphs.run_mixed, graphs.run
    graphs.run_mixed = lambda *a, **k: calls.append(len(a[0])) or run_mixed(*a, **k)
    graphs.run = lambda *a, **k: longest.append(max(a[3])) or run(*a, **k)
    got = _run(llm, prompts, params, loras)
    assert len(calls) >= 3
    assert min(longest) <= 19 < max(longest)
    for exp_req, got_req in zip(expected, got):
        for (e_ids, e_cum, _, e_fin), (g_ids, g_cum, _, g_fin) in zip(exp_req, got_req):
            assert g_ids == e_ids and g_fin == e_fin
            assert g_cum == pytest.approx(e_cum, abs=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_mixed_graphs_with_async_placeholders_on_gpu(tiny_llama_dir, adapters):
    """On a GPU, float32, async scheduling: captured mixed graphs whose decode rows take their input token
    from the step in flight (written into the graph's input buffer after the upload, same stream) give the
    sync eager engine's tokens."""
    kw = {"model": str(tiny_llama_dir), "device": "cuda", "dtype": "float32", "max_model_len": 64,
          "block_size": 4, "num_kv_blocks": 256, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
          "max_num_seqs": 8, "max_num_batched_tokens": 20}
    prompts, params, loras = _overlappable_requests(adapters)
    expected = _run(LLM(**kw, enforce_eager=True), prompts, params, loras)
    llm = LLM(**kw, async_scheduling=True)
    graphs = llm.engine.runner.graphs
    fixed = []
    run_mixed = graphs.run_mixed
    graphs.run_mixed = lambda *a, **k: fixed.append(k.get("input_fix") is not None) or run_mixed(*a, **k)
    got = _run(llm, prompts, params, loras)
    assert llm.engine.num_overlapped_steps > 0 and sum(fixed) >= 2
    for exp_req, got_req in zip(expected, got):
        for (e_ids, e_cum, _, e_fin), (g_ids, g_cum, _, g_fin) in zip(exp_req, got_req):
            assert g_ids == e_ids and g_fin == e_fin
            assert g_cum == pytest.approx(e_cum, abs=1e-3)
