"""The per-step fast paths (issue 9) give exactly what the general paths give.

- CUDA-graph decode steps, emulated on the CPU: the graph runner's static
  buffers are filled as on a GPU and a stand-in "replay" runs the model on
  them; every request then equals the eager engine (tokens, logprobs), with
  LoRA and base rows mixed, seeded sampling, top logprobs and an ``n = 2``
  fork, while the batch shrinks and block-table rows shift.
- ``KVCacheManager.try_allocate_slots`` = ``can_allocate`` + ``allocate_slots``.
- The greedy-only sampling batch = the general one, field by field.
- ``Sequence.output_token_ids`` follows ``append_token``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_peft_adapter

from loraplex import LLM, LoRARequest, SamplingParams
from loraplex.engine import cuda_graphs
from loraplex.engine.cuda_graphs import CudaGraphRunner, _Graph
from loraplex.engine.kv_cache_manager import KVCacheManager
from loraplex.engine.model_runner import _to_device
from loraplex.engine.models.llama import LoRABatch
from loraplex.engine.sampler import Sampler, SamplingBatch, SamplingRow
from loraplex.engine.sequence import RequestGroup, Sequence
from loraplex.kernels import attention_decode
from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_mapping import LoRAMapping, plan_segments


VARIANTS = ((False, False), (True, False), (True, True))  # (with_lora, with_dora) graphs per size


class _EagerReplay:
    """Stands in for a captured graph on the CPU: runs the model on the graph runner's
    static buffers (exactly what a replay reads) and writes the graph's output tensor.
    Also checks the SGMV segments the graph builds against a host grouping of its token slots."""

    def __init__(self, graphs: CudaGraphRunner, size: int, with_lora: bool, hidden: torch.Tensor,
                 with_dora: bool = False, context: int = 0) -> None:
        self.graphs, self.size, self.with_lora, self.hidden = graphs, size, with_lora, hidden
        self.with_dora, self.context = with_dora, context
        self.replays = 0

    def replay(self) -> None:
        g, n = self.graphs, self.size
        seq_lens = g.seq_lens[:n].tolist()
        smaller = [c for c in g.context_buckets if c < self.context]  # the step's graph: the smallest bucket holding it
        assert (smaller[-1] if smaller else 0) < max(seq_lens) <= self.context
        meta = AttentionMetadata(query_start_loc=g.query_start_loc[:n + 1], seq_lens=g.seq_lens[:n],
                                 block_tables=g.block_tables[:n], slot_mapping=g.slot_mapping[:n], max_query_len=1,
                                 max_seq_len=max(seq_lens), query_start_loc_host=list(range(n + 1)),
                                 seq_lens_host=seq_lens)
        lora = LoRABatch(self._checked_mapping(), dora=self.with_dora) if self.with_lora else None
        with torch.inference_mode():
            self.hidden.copy_(g.model(g.input_ids[:n], g.positions[:n], g.kv_layers, meta, lora))
        self.replays += 1

    def _checked_mapping(self) -> LoRAMapping:
        """What the captured graph builds from the static buffers (the runner's own ``_lora``), checked
        against the grouping of the same token slots on the host."""
        g, n = self.graphs, self.size
        mapping = g._lora(n).mapping
        host = plan_segments(g.token_slots[:n].cpu().clone(), g.num_lora_slots)
        assert mapping.segments_host() == host.segments_host() != []
        assert mapping.sorted_token_ids.tolist() == host.sorted_token_ids.tolist()
        return mapping


def _emulate_graphs(llm: LLM) -> list[_EagerReplay]:
    engine = llm.engine
    graphs = CudaGraphRunner(engine.model, engine.kv_cache.layers, engine.config.block_size, engine.max_model_len,
                             engine.config.max_num_seqs, engine.config.max_loras, engine.device)
    replays = []
    for size in graphs.sizes:
        for (with_lora, with_dora), context in itertools.product(VARIANTS, graphs.context_buckets):
            hidden = torch.full((size, engine.spec.hidden_size), float("nan"), device=engine.device, dtype=engine.dtype)
            replay = _EagerReplay(graphs, size, with_lora, hidden, with_dora, context)
            graphs.graphs[(size, with_lora, with_dora, context)] = _Graph(replay, hidden)
            replays.append(replay)
    engine.runner.graphs = graphs
    return replays


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("fastpath-adapters")
    return [LoRARequest(name, i + 1, str(make_peft_adapter(tiny_llama_dir, root / name, r=8, seed=20 + i,
                                                            targets=("q_proj", "v_proj", "down_proj"))))
            for i, name in enumerate(("x", "y"))]


def _requests(tiny_llama_dir, adapters):
    rng = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (int(n),), generator=rng).tolist() for n in (5, 9, 3, 14, 7, 1, 11)]
    greedy = {"temperature": 0.0, "ignore_eos": True}
    params = [SamplingParams(max_tokens=24, **greedy),
              SamplingParams(max_tokens=6, logprobs=3, **greedy),
              SamplingParams(max_tokens=17, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=9, **greedy),
              SamplingParams(max_tokens=15, repetition_penalty=1.3, min_tokens=4, **greedy),
              SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=11, ignore_eos=True),
              SamplingParams(max_tokens=4, **greedy)]
    loras = [None, adapters[0], adapters[1], adapters[0], None, adapters[1], None]
    return [{"prompt_token_ids": p} for p in prompts], params, loras


def _run(llm: LLM, prompts, params, loras):
    outs = llm.generate(prompts, params, loras)
    return [[(c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("three_stages_from", [None, 20])
def test_graph_decode_steps_equal_eager_steps(tiny_llama_dir, adapters, monkeypatch, three_stages_from):
    """Decode steps on the (emulated) graphs equal eager steps; with decode attention configs that change at 20
    positions of context, graphs are kept for contexts of up to 19 and up to 64 positions, and each step replays the
    smallest holding its longest context (checked in every replay)."""
    if three_stages_from is not None:
        monkeypatch.setattr(attention_decode, "THREE_STAGES_FROM", three_stages_from)
    kw = {"model": str(tiny_llama_dir), "max_model_len": 64, "block_size": 4, "num_kv_blocks": 256,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_seqs": 8}
    prompts, params, loras = _requests(tiny_llama_dir, adapters)
    expected = _run(LLM(**kw), prompts, params, loras)
    graph_llm = LLM(**kw)
    replays = _emulate_graphs(graph_llm)
    got = _run(graph_llm, prompts, params, loras)
    assert sum(r.replays for r in replays if r.with_lora) > 10
    assert sum(r.replays for r in replays if not r.with_lora) > 0
    assert len({r.size for r in replays if r.replays}) >= 3  # the batch shrank across padded sizes
    buckets = (19, 64) if three_stages_from else (64,)
    assert graph_llm.engine.runner.graphs.context_buckets == buckets
    assert {r.context for r in replays if r.replays} == set(buckets)
    for exp_req, got_req in zip(expected, got):
        for (e_ids, e_cum, e_lp, e_fin), (g_ids, g_cum, g_lp, g_fin) in zip(exp_req, got_req):
            assert g_ids == e_ids and g_fin == e_fin
            assert g_cum == pytest.approx(e_cum, abs=1e-4)
            if e_lp is not None:
                for e_pos, g_pos in zip(e_lp, g_lp):
                    assert list(g_pos) == list(e_pos)
                    assert list(g_pos.values()) == pytest.approx(list(e_pos.values()), abs=1e-4)


def test_decode_step_replays_the_smallest_context_bucket_holding_its_longest_context(monkeypatch):
    """``seq_lens`` count the step's new token: a longest context of exactly the lower bucket's top replays that
    bucket, one more the next; padding rows (context 1) never pick a bucket; without buckets, one graph per size."""
    monkeypatch.setattr(attention_decode, "THREE_STAGES_FROM", 20)
    replayed = []

    class Recorded:
        def __init__(self, key):
            self.key = key

        def replay(self):
            replayed.append(self.key)

    def run(graphs, seq_lens):
        b = len(seq_lens)
        graphs.run([0] * b, [s - 1 for s in seq_lens], [-1] * b, seq_lens, [[0] * -(-s // 4) for s in seq_lens], None)

    graphs = CudaGraphRunner(None, None, 4, 64, 8, 0, torch.device("cpu"))
    assert graphs.context_buckets == (19, 64)
    for size, context in itertools.product(graphs.sizes, graphs.context_buckets):
        graphs.graphs[(size, False, False, context)] = _Graph(Recorded((size, context)), torch.zeros(size, 1))
    for seq_lens in ([19, 1, 1], [1, 20, 1], [1], [64, 3, 5, 2, 1]):
        run(graphs, seq_lens)
    assert replayed == [(4, 19), (4, 64), (1, 19), (8, 64)]
    previous = cuda_graphs.use_context_buckets(False)
    try:
        assert CudaGraphRunner(None, None, 4, 64, 8, 0, torch.device("cpu")).context_buckets == (64,)
    finally:
        cuda_graphs.use_context_buckets(previous)


def test_fork_and_prompt_chunk_in_one_step(tiny_llama_dir):
    """A step where one group forks (2 samples) and another sequence only computes
    a prompt chunk (0 samples): each sample goes to its own sequence."""
    rng = torch.Generator().manual_seed(9)
    short, long = (torch.randint(3, 300, (n,), generator=rng).tolist() for n in (4, 40))
    fork = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = {"model": str(tiny_llama_dir), "max_model_len": 64, "block_size": 4, "num_kv_blocks": 128}
    solo = [_run(LLM(**kw), [{"prompt_token_ids": p}], [params], [None])[0]
            for p, params in ((short, fork), (long, greedy))]
    llm = LLM(**kw, max_num_batched_tokens=16)  # the long prompt is chunked next to the fork
    got = _run(llm, [{"prompt_token_ids": short}, {"prompt_token_ids": long}], [fork, greedy], [None, None])
    for exp_req, got_req in zip(solo, got):
        assert [c[0] for c in got_req] == [c[0] for c in exp_req]
        assert [c[1] for c in got_req] == pytest.approx([c[1] for c in exp_req], abs=1e-4)


def _seq(tokens: list[int], seq_id: int) -> Sequence:
    group = RequestGroup(f"r{seq_id}", None, list(tokens), SamplingParams(), None, None)
    seq = Sequence(seq_id, group, 0, list(tokens), len(tokens), None, None)
    group.seqs.append(seq)
    return seq


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "append", "fork", "free"]), st.integers(0, 7),
                          st.integers(1, 6)), max_size=50))
def test_try_allocate_slots_equals_check_then_allocate(ops):
    managers = [KVCacheManager(num_blocks=20, block_size=4, enable_prefix_caching=False) for _ in range(2)]
    live: list[list[Sequence]] = [[], []]
    for next_id, (op, pick, n) in enumerate(ops):
        for kv, seqs in zip(managers, live):
            fast = kv is managers[1]
            if op == "new" or not seqs:
                seq = _seq([pick] * n, next_id + 1)
                todo = seq.num_tokens
                ok = kv.try_allocate_slots(seq, todo) if fast else kv.can_allocate(seq, todo)
                if ok and not fast:
                    kv.allocate_slots(seq, todo)
                if ok:
                    seq.num_computed_tokens = seq.num_tokens
                    seqs.append(seq)
            elif op == "append":
                seq = seqs[pick % len(seqs)]
                seq.token_ids.extend([pick] * n)
                ok = kv.try_allocate_slots(seq, n) if fast else kv.can_allocate(seq, n)
                if ok and not fast:
                    kv.allocate_slots(seq, n)
                if ok:
                    seq.num_computed_tokens += n
                else:
                    del seq.token_ids[-n:]
            elif op == "fork":
                parent = seqs[pick % len(seqs)]
                child = _seq(list(parent.token_ids), next_id + 1)
                child.num_computed_tokens = parent.num_computed_tokens
                kv.fork(parent, child)
                seqs.append(child)
            else:
                kv.free(seqs.pop(pick % len(seqs)))
        a, b = (kv.take_pending() for kv in managers)
        assert (a.copy, a.swap_in, a.swap_out) == (b.copy, b.swap_in, b.swap_out)
        assert [managers[0].block_ids(s) for s in live[0]] == [managers[1].block_ids(s) for s in live[1]]
        assert managers[0].pool.ref_cnt == managers[1].pool.ref_cnt


def test_greedy_batch_equals_general_batch():
    vocab = 12
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], [3], None, {0}),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=2, min_tokens=1), [4], [5], None, {0})]
    fast = SamplingBatch.build(rows, vocab, "cpu")
    assert fast.all_greedy
    # one row that needs the general path (min_tokens not reached) forces it for the batch
    general = SamplingBatch.build(rows + [SamplingRow(SamplingParams(temperature=0.0, min_tokens=3), [4], [5],
                                                      None, {0})], vocab, "cpu")
    assert general.banned_mask is not None
    assert torch.equal(fast.temperature, general.temperature[:2])
    assert torch.equal(fast.greedy, general.greedy[:2])
    assert (fast.min_p, fast.top_k, fast.top_p, fast.banned_mask, fast.penalties) == (None,) * 5
    assert (general.min_p, general.top_k, general.top_p, general.penalties) == (None,) * 4
    assert fast.num_logprobs == general.num_logprobs[:2] and fast.generators == general.generators[:2]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, fast)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.sampled_logprobs == [raw[b, t].item() for b, t in enumerate(out.token_ids)]
    assert out.logprobs[0] is None and list(out.logprobs[1])[:2] == raw[1].topk(2).indices.tolist()


def test_output_token_ids_follow_append_token():
    seq = _seq([7, 8, 9], 1)
    assert seq.output_token_ids == [] and seq.num_output_tokens == 0
    live = seq.output_token_ids
    for t in (4, 5):
        seq.append_token(t)
    assert seq.token_ids == [7, 8, 9, 4, 5] and live == [4, 5] and seq.num_output_tokens == 2
    resumed = Sequence(2, seq.group, 0, [7, 8, 9, 4], 3, None, None)
    assert resumed.output_token_ids == [4]


def test_packed_host_to_device_copy_keeps_each_tensor_aligned():
    tensors = [torch.arange(n, dtype=torch.int32) for n in (5, 16, 1, 33)]
    assert _to_device(tensors, torch.device("cpu")) == tensors  # nothing to move
    moved = _to_device(tensors, torch.device("meta"))  # one packed copy, then views
    assert [(t.shape, t.dtype) for t in moved] == [(t.shape, t.dtype) for t in tensors]
    assert all(t._base is not None and t._base is moved[0]._base for t in moved)
    assert [t.storage_offset() for t in moved] == [0, 16, 32, 48]


def test_async_scheduling_graph_steps_equal_sync_eager_steps(tiny_llama_dir, adapters):
    """Async scheduling on the CUDA-graph decode path (emulated): the placeholder of each row is
    written over the graph's input ids from the previous step's samples (same rows: a slice;
    rows shifted as the batch shrinks: an index); tokens equal the sync eager engine's."""
    kw = {"model": str(tiny_llama_dir), "max_model_len": 64, "block_size": 4, "num_kv_blocks": 256,
          "enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_num_seqs": 8}
    prompts, params, loras = _requests(tiny_llama_dir, adapters)
    expected = _run(LLM(**kw), prompts, params, loras)
    async_llm = LLM(**kw, async_scheduling=True)
    replays = _emulate_graphs(async_llm)
    got = _run(async_llm, prompts, params, loras)
    assert async_llm.engine.num_overlapped_steps > 5
    assert sum(r.replays for r in replays) > 10
    for exp_req, got_req in zip(expected, got):
        for (e_ids, e_cum, _, e_fin), (g_ids, g_cum, _, g_fin) in zip(exp_req, got_req):
            assert g_ids == e_ids and g_fin == e_fin
            assert g_cum == pytest.approx(e_cum, abs=1e-4)
