"""What the model forward of one step needs, as plain host lists (no ``Sequence`` objects).

The model runner turns a :class:`~loraplex.engine.scheduler.ScheduledBatch` into a
:class:`StepPlan` once; the forward pass is built from the plan alone. With tensor parallelism
the driver broadcasts the plan to the other ranks (``loraplex.engine.worker``), which run the
same forward on their shards, so it holds only what the forward reads: a few ints per token
and the block table of each sequence.

Per sequence b (B sequences, T tokens in all)::

    | computed before (seq_lens[b] - q_lens[b] tokens) | scheduled now (q_lens[b] tokens) |
                                                        ^ token_ids[query_start[b] : query_start[b + 1]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from loraplex.engine.kv_cache_manager import BlockCopies


@dataclass(frozen=True)
class StepPlan:
    """One step's forward inputs.

    - ``token_ids``: ``T`` token ids, the scheduled tokens of every sequence in batch order.
    - ``q_lens``: ``B`` tokens scheduled per sequence; ``seq_lens``: ``B`` tokens in the KV cache
      after the step (positions of sequence b's tokens: ``seq_lens[b] - q_lens[b] ..
      seq_lens[b] - 1``).
    - ``block_tables``: ``B`` lists of KV block ids (the sequence's whole table).
    - ``lora_slots``: ``B`` adapter slots (-1 = base model), or None when no sequence uses one.
    - ``lora_dora``: some slot of ``lora_slots`` holds a DoRA adapter (the linears rescale by its gains).
    - ``block_copies``: KV block moves to do before the forward.
    - ``use_graph``: replay a captured decode CUDA graph (every ``q_lens[b] == 1``); decided
      once, by the driver, so that every rank takes the same path.
    - ``use_mixed_graph``: replay a captured mixed-step graph (prompt chunks and decodes over a
      padded token bucket, ``engine/cuda_graphs.py``); decided likewise.
    """

    token_ids: list[int]
    q_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    lora_slots: list[int] | None
    block_copies: BlockCopies = field(default_factory=BlockCopies)
    use_graph: bool = False
    use_mixed_graph: bool = False
    lora_dora: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def query_start(self) -> list[int]:
        """``B + 1`` offsets of each sequence's first token in ``token_ids``."""
        return list(accumulate(self.q_lens, initial=0))

    @property
    def sample_token_index(self) -> list[int]:
        """Row of the forward's output holding each sequence's last token (``B``)."""
        if self.use_graph:  # the graph's output has one row per sequence
            return list(range(self.num_seqs))
        return [q - 1 for q in self.query_start[1:]]
