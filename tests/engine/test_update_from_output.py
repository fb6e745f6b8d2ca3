"""``Scheduler.update_from_output`` owns the post-step state: exact values after each step.

A letter tokenizer (token i decodes to the i-th lowercase letter, 26 = EOS) and real
:class:`SequenceTextState`s; the KV cache manager with 4-token blocks; hand-made step
results (the model's part), so every value below is known in advance: computed tokens,
token lists, block tables, reference counts, block hashes, finish reasons, freed blocks.
"""

from __future__ import annotations

from loraplex.engine.detokenizer import SequenceTextState
from loraplex.engine.kv_cache_manager import KVCacheManager
from loraplex.engine.model_runner import SampledToken, StepResult
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.engine.sequence import RequestGroup, Sequence, SequenceStatus

EOS = 26


class LetterTokenizer:
    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in token_ids if t != EOS or not skip_special_tokens)


def make(num_blocks: int = 16, swap: int = 0, budget: int = 64) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=True, num_swap_blocks=swap)
    return Scheduler(SchedulerConfig(8, budget, 0, 64), kv)


_next_id = [0]


def add(scheduler: Scheduler, name: str, prompt: list[int], params: SamplingParams) -> RequestGroup:
    group = RequestGroup(name, None, list(prompt), params, None, None)
    for index in range(params.n):
        _next_id[0] += 1
        state = SequenceTextState(LetterTokenizer(), group.prompt_token_ids, params, {EOS}, params.max_tokens)
        group.seqs.append(Sequence(_next_id[0], group, index, list(prompt), len(prompt), None, state,
                                   logprobs=[] if params.logprobs is not None else None))
    scheduler.add(group.seqs[0])
    return group


def result(batch, *tokens_per_seq: list[int]) -> StepResult:
    return StepResult([[SampledToken(t, -0.5, None) for t in tokens] for tokens in tokens_per_seq],
                      [None] * len(batch.seqs))


class _Committing:
    """``update_from_output`` after ``commit`` (what the engine does once a step is launched)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def __call__(self, batch, result):
        self.scheduler.commit(batch)
        return self.scheduler.update_from_output(batch, result)


def test_prefill_decode_length_finish_exact_state():
    s = make()
    kv = s.kv
    group = add(s, "r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    seq = group.seqs[0]
    batch = s.schedule()
    assert [(i.start_position, i.num_new_tokens, i.num_samples) for i in batch.seqs] == [(0, 6, 1)]
    assert batch.seqs[0].block_ids == [0, 1]
    assert seq.num_computed_tokens == 0  # nothing is computed before the step is launched
    s.commit(batch)  # launched: computed, and a placeholder for the token being sampled
    assert (seq.num_computed_tokens, seq.token_ids, seq.num_pending_tokens) == (6, [1, 2, 3, 4, 5, 6, -1], 1)
    update = s.update_from_output(batch, result(batch, [7]))
    assert (update.groups, update.num_generated_tokens) == ([(group, False)], 1)
    assert seq.num_computed_tokens == 6 and seq.token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert seq.output_token_ids == [7] and seq.cumulative_logprob == -0.5
    assert kv.block_ids(seq) == [0, 1] and len(kv.block_hashes(seq)) == 1  # one full computed block
    assert seq.text_state.text == "h"

    batch = s.schedule()
    assert [(i.start_position, i.num_new_tokens, i.num_samples) for i in batch.seqs] == [(6, 1, 1)]
    _Committing(s)(batch, result(batch, [8]))
    assert seq.num_computed_tokens == 7 and kv.block_ids(seq) == [0, 1] and len(kv.block_hashes(seq)) == 1
    batch = s.schedule()
    update = _Committing(s)(batch, result(batch, [9]))
    assert update.groups == [(group, True)]
    assert (seq.status, seq.finish_reason, seq.stop_reason) == (SequenceStatus.FINISHED, "length", None)
    assert seq.output_token_ids == [7, 8, 9] and seq.text_state.text == "hij"
    # finished: every block given back (the full computed ones stay cached for reuse)
    assert kv.block_ids(seq) == [] and kv.num_tables() == 0 and s.running == []
    assert kv.pool.num_free_blocks == 16 and kv.pool.stats().cached == 2


def test_eos_and_stop_string_finish():
    s = make()
    eos = add(s, "eos", [1, 2], SamplingParams(max_tokens=10))
    stop = add(s, "stop", [3, 4], SamplingParams(max_tokens=10, stop=["cd"]))
    batch = s.schedule()
    _Committing(s)(batch, result(batch, [EOS], [2]))
    assert (eos.seqs[0].finish_reason, eos.seqs[0].stop_reason, eos.seqs[0].output_token_ids) == ("stop", None, [EOS])
    assert stop.seqs[0].status is SequenceStatus.RUNNING
    batch = s.schedule()
    assert [i.seq.group.request_id for i in batch.seqs] == ["stop"]
    update = _Committing(s)(batch, result(batch, [3]))
    assert update.groups == [(stop, True)]
    assert (stop.seqs[0].finish_reason, stop.seqs[0].stop_reason, stop.seqs[0].text_state.text) == ("stop", "cd", "")
    assert s.kv.pool.num_free_blocks == 16 and s.kv.num_tables() == 0


def test_n2_fork_shares_blocks_then_copy_on_write():
    s = make()
    kv = s.kv
    group = add(s, "n2", [1, 2, 3, 4, 5, 6], SamplingParams(n=2, max_tokens=2, ignore_eos=True, logprobs=0))
    parent, child = group.seqs
    batch = s.schedule()
    assert batch.seqs[0].num_samples == 2
    update = _Committing(s)(batch, result(batch, [7, 8]))
    assert update.num_generated_tokens == 2 and group.forked
    assert (parent.token_ids[-1], child.token_ids[-1]) == (7, 8)
    assert child.status is SequenceStatus.RUNNING and child.num_computed_tokens == 6
    assert kv.block_ids(child) == kv.block_ids(parent) == [0, 1]
    assert kv.pool.ref_cnt[:2] == [2, 2] and kv.block_hashes(child) == kv.block_hashes(parent)
    assert child.logprobs == [{8: -0.5}] and parent.logprobs == [{7: -0.5}]
    assert s.running == [parent, child]
    batch = s.schedule()  # both write position 6, in the shared partial block 1: the parent copies it
    assert batch.block_copies.copy == [(1, 2)]
    assert kv.block_ids(parent) == [0, 2] and kv.block_ids(child) == [0, 1]
    update = _Committing(s)(batch, result(batch, [9], [10]))
    assert update.groups == [(group, True)]
    assert parent.output_token_ids == [7, 9] and child.output_token_ids == [8, 10]
    assert kv.pool.num_free_blocks == 16 and kv.num_tables() == 0


def test_recompute_preemption_and_abort_share_the_reset_path():
    s = make(num_blocks=3)
    kv = s.kv
    old = add(s, "old", [1, 2, 3], SamplingParams(max_tokens=10, ignore_eos=True))
    batch = s.schedule()
    _Committing(s)(batch, result(batch, [4]))
    new = add(s, "new", [5, 6, 7, 11, 12], SamplingParams(max_tokens=10, ignore_eos=True))
    batch = s.schedule()
    _Committing(s)(batch, result(batch, [8], [9]))
    a, b = old.seqs[0], new.seqs[0]
    assert (kv.block_ids(a), kv.block_ids(b), kv.pool.num_free_blocks) == ([0], [1, 2], 0)
    # a needs a second block at position 4: the newest running sequence (b) is preempted
    batch = s.schedule()
    assert batch.num_preempted == 1 and [i.seq for i in batch.seqs] == [a]
    assert (b.status, b.num_computed_tokens, b.token_ids, b.num_preemptions) == (
        SequenceStatus.WAITING, 0, [5, 6, 7, 11, 12, 9], 1)
    assert kv.block_ids(b) == [] and kv.block_hashes(b) == [] and list(s.waiting) == [b]
    _Committing(s)(batch, result(batch, [10]))
    assert a.num_computed_tokens == 5
    # abort (same reset path): out of its queue, blocks back, tokens kept
    s.finish_group(new, "abort")
    assert (b.status, b.finish_reason, b.num_computed_tokens, b.token_ids) == (
        SequenceStatus.FINISHED, "abort", 0, [5, 6, 7, 11, 12, 9])
    assert list(s.waiting) == [] and s._queued == {}
    s.finish_group(old, "abort")
    assert s.running == [] and kv.num_tables() == 0 and kv.pool.num_free_blocks == 3


def test_abort_of_a_swapped_sequence_frees_host_blocks():
    s = make(num_blocks=3, swap=4)
    kv = s.kv
    old = add(s, "old", [1, 2, 3, 4], SamplingParams(max_tokens=10, ignore_eos=True))
    new = add(s, "new", [5, 6, 7, 8, 9], SamplingParams(max_tokens=10, ignore_eos=True))
    batch = s.schedule()
    _Committing(s)(batch, result(batch, [4], [1]))
    batch = s.schedule()  # old needs a block at position 4: new (2 blocks) is swapped out
    assert batch.block_copies.swap_out == [(1, 0), (2, 1)] and list(s.swapped) == [new.seqs[0]]
    assert new.seqs[0].num_computed_tokens == 5 and kv.is_swapped(new.seqs[0])
    s.finish_group(new, "abort")
    assert kv.swap_pool.num_free_blocks == 4 and not kv.is_swapped(new.seqs[0]) and list(s.swapped) == []
    assert new.seqs[0].status is SequenceStatus.FINISHED and s._queued == {}
    # new's blocks were freed deepest first (2, then 1): old takes block 2
    assert [i.seq for i in batch.seqs] == old.seqs and kv.block_ids(old.seqs[0]) == [0, 2]


def test_sequence_aborted_between_launch_and_update_is_skipped():
    s = make()
    group = add(s, "r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    batch = s.schedule()
    s.commit(batch)
    s.finish_group(group, "abort")  # its placeholder goes with it
    update = s.update_from_output(batch, result(batch, [5]))
    seq = group.seqs[0]
    assert (update.groups, update.num_generated_tokens) == ([], 0)
    assert seq.token_ids == [1, 2, 3] and seq.output_token_ids == [] and seq.num_pending_tokens == 0
    assert seq.num_computed_tokens == 0 and seq.finish_reason == "abort"
    assert s.kv.pool.num_free_blocks == 16
