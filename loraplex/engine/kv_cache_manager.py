"""Block tables of sequences over a :class:`BlockPool`: allocation of slots
for new tokens, prefix-cache lookup, forking with copy-on-write, swapping.

The manager is the one owner of every sequence's block table and block hashes
(keyed by ``seq_id``; a :class:`~loraplex.engine.sequence.Sequence` holds none).
Others read a table through :meth:`KVCacheManager.block_ids` (the live list, to
read only: the scheduler hands it to the model runner in ``ScheduledSeq.block_ids``)
and change it only through the manager's methods.

Prefix caching (vLLM automatic prefix caching): every *full* block gets a
hash chained from its parent's hash, its token ids and the sequence's extra
keys: the adapter's version id (the same tokens under another adapter give
other KV) and the tenant id, a salt as vLLM's ``cache_salt``: tenants never
share cached blocks, so no tenant can tell from its time to first token that
another tenant sent the same prompt (a timing side channel). Requests of one
tenant share blocks; the anonymous tenant ``""`` (the offline ``LLM`` API)
shares with itself only::

    hash_i = sha256(hash_{i-1} || token_ids[i*bs:(i+1)*bs] || extra_keys)

Blocks are hashed only once their KV has been computed. A sequence's last,
partial block is never shared through the prefix cache.

Sliding window (every layer attends to the same last W positions: Mistral, Phi-3 with
``sliding_window``, Qwen2/3 when every layer slides): a query at position p reads keys ``> p - W``
only, so once a sequence has computed ``c`` tokens its next queries (positions >= c) never read
positions ``< c - W + 1``. At each allocation, and after each step (``Scheduler.update_from_output``),
the manager frees every block wholly below that position (vLLM v1
``SlidingWindowManager.remove_skipped_blocks``) and leaves :data:`NULL_BLOCK` in its table entry, so
positions still index the table and a long sequence holds about ``W / block_size + 1`` blocks::

    | NULL .. NULL | block with c - W + 1 | ... | block with c - 1 | blocks for this step's tokens |
                    ^ first position a query of this step may read

The attention kernels start their key loops at the window's first position (``seq_len - W`` for a
decode row, ``first query position - W + 1`` for a prefill tile), so they never read a NULL entry.
With prefix caching a freed block keeps its hash in the free queue like any freed block (its content
is the KV of its tokens, whatever the window) and a later prefix hit may revive it; lookups match the
chain from block 0 as for every model, so an evicted early block ends the hit there (vLLM can hit
with only the window's blocks cached; not done here). Swapping moves the held blocks and keeps the
NULL entries; a fork shares the held blocks (reference counts), each sequence frees its own references.
Models whose layers differ (Gemma 2/3: global layers between sliding ones; Qwen2/3 whose
``max_window_layers`` leaves global layers) free nothing.

Copy-on-write: a sequence about to write into a block it shares (only the
partial last block after an ``n > 1`` fork can be shared and written) gets a
private copy first; the copy is recorded in :attr:`KVCacheManager.pending_copies`
for the model runner to perform before the step's forward pass.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from loraplex.engine.block_pool import BlockPool
from loraplex.engine.sequence import Sequence


@dataclass
class BlockCopies:
    """Block moves the model runner performs before a step's forward pass,
    in this order: swap out (device -> host), swap in (host -> device),
    copy-on-write (device -> device). Each entry is ``(src_block, dst_block)``."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in / served from the prefix cache, at each sequence's first admission (a
    recompute preemption's re-admission, which may find the sequence's own prompt and output blocks, is not a
    prompt lookup and is not counted)."""

    queries_tokens: int = 0
    hits_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else 0.0


@dataclass(frozen=True)
class ComputedBlocks:
    """A prefix-cache lookup's result: the cached blocks (and their hashes) holding the
    first ``num_tokens`` tokens of a sequence. Nothing is referenced until committed."""

    block_ids: tuple[int, ...] = ()
    block_hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0


NULL_BLOCK = -1
"""The table entry of a block freed for lying wholly outside the sliding window (never read)."""


def uniform_sliding_window(layer_windows: tuple[int | None, ...]) -> int | None:
    """The window W when every layer uses the same sliding window of W tokens, else None (some layer
    attends to everything, or the windows differ: no block may be freed)."""
    windows = set(layer_windows)
    if len(windows) != 1:
        return None
    return next(iter(windows))


def hash_block(parent: bytes, token_ids: list[int], extra_key: str) -> bytes:
    """Chained content hash of one full block (see module docstring)."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    h.update(extra_key.encode())
    return h.digest()


class KVCacheManager:
    """Maps sequences to physical KV blocks on the device and in host swap space."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_swap_blocks: int = 0,
                 sliding_window: int | None = None) -> None:
        """``sliding_window``: W tokens when every layer attends to the last W positions only (see the module
        docstring: blocks wholly outside the window are freed); None = keep every block.

        Raises:
            ValueError: ``sliding_window`` < 1.
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"KVCacheManager.sliding_window={sliding_window}: must be >= 1 or None")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_stats = PrefixCacheStats()
        self.pending = BlockCopies()
        self._swapped: dict[int, list[int]] = {}
        self._tables: dict[int, list[int]] = {}  # seq_id -> device block ids, logical order
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> hashes of its full computed blocks

    # -- block tables -------------------------------------------------------
    def block_ids(self, seq: Sequence) -> list[int]:
        """``seq``'s device block table (physical block id per logical block): the live list,
        read-only for callers ([] when it holds none)."""
        table = self._tables.get(seq.seq_id)
        if table is None:
            table = self._tables[seq.seq_id] = []
        return table

    def block_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of ``seq``'s full, computed blocks (prefix caching), read-only for callers."""
        return self._hashes.get(seq.seq_id, [])

    def num_held_blocks(self, seq: Sequence) -> int:
        """Device blocks ``seq`` holds (its table less the NULL entries of blocks freed outside the window)."""
        return sum(1 for block in self._tables.get(seq.seq_id, ()) if block != NULL_BLOCK)

    def num_tables(self) -> int:
        """Sequences holding a device block table or swapped blocks (0 once all are freed)."""
        return sum(1 for t in self._tables.values() if t) + len(self._swapped)

    # -- sizing -----------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New device blocks for computing ``num_new_tokens`` more tokens of
        ``seq``, including a copy-on-write of a shared last block."""
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        needed = max(0, total - len(self.block_ids(seq)))
        return needed + int(self._needs_cow(seq))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def _needs_cow(self, seq: Sequence) -> bool:
        first = seq.num_computed_tokens // self.block_size
        table = self.block_ids(seq)
        return first < len(table) and self.pool.ref_cnt[table[first]] > 1

    # -- allocation -------------------------------------------------------
    def try_allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """:meth:`allocate_slots` if the blocks are available, else False (nothing changes).

        O(1) when nothing is needed: the common decode step, whose token lands in
        an unshared block the sequence already holds.
        """
        computed, block_ids = seq.num_computed_tokens, self.block_ids(seq)
        if self.sliding_window is not None:
            self.free_blocks_outside_window(seq)
        first = computed // self.block_size
        if (computed + num_new_tokens <= len(block_ids) * self.block_size and first < len(block_ids)
                and self.pool.ref_cnt[block_ids[first]] == 1):
            return True
        if self.num_blocks_needed(seq, num_new_tokens) > self.pool.num_free_blocks:
            return False
        self.allocate_slots(seq, num_new_tokens)
        return True

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Make room for tokens ``[num_computed, num_computed + num_new_tokens)``.

        Raises:
            NoFreeBlocksError: callers must check :meth:`can_allocate` first.
        """
        table = self.block_ids(seq)
        if self.sliding_window is not None:
            self.free_blocks_outside_window(seq)
        if self._needs_cow(seq):
            idx = seq.num_computed_tokens // self.block_size
            old = table[idx]
            new = self.pool.allocate()
            self.pending.copy.append((old, new))
            self.pool.free(old)
            table[idx] = new
        total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        while len(table) < total:
            table.append(self.pool.allocate())

    def free_blocks_outside_window(self, seq: Sequence) -> int:
        """Sliding window: free ``seq``'s blocks that lie wholly below position ``num_computed_tokens - W + 1``
        (no query from here on reads them), deepest first, leaving :data:`NULL_BLOCK` in their entries.
        Returns how many were freed. Called by the allocations; a no-op without a window.
        """
        if self.sliding_window is None:
            return 0
        first_read = seq.num_computed_tokens - self.sliding_window + 1
        table = self.block_ids(seq)
        i = min(max(first_read, 0) // self.block_size, len(table)) - 1
        freed = 0
        while i >= 0 and table[i] != NULL_BLOCK:  # NULL entries are always a prefix of the table
            self.pool.free(table[i])
            table[i] = NULL_BLOCK
            i -= 1
            freed += 1
        return freed

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s device blocks, deepest first (eviction order), and forget
        its block hashes (a recomputed sequence hashes its blocks again)."""
        for block in reversed(self._tables.pop(seq.seq_id, ())):
            if block != NULL_BLOCK:
                self.pool.free(block)
        self._hashes.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (holding no blocks) shares every block of ``parent`` (reference counts + 1; NULL
        entries stay NULL)."""
        table = self.block_ids(parent)
        for block in table:
            if block != NULL_BLOCK:
                self.pool.incref(block)
        self._tables[child.seq_id] = list(table)
        self._hashes[child.seq_id] = list(self.block_hashes(parent))

    # -- prefix caching ---------------------------------------------------
    def extra_key(self, seq: Sequence) -> str:
        """The adapter version and the tenant (a salt): blocks are shared only within both."""
        group = seq.group
        return f"{group.lora_version or ''}\x00{group.tenant_id}" if group.tenant_id else group.lora_version or ""

    def get_computed_blocks(self, seq: Sequence) -> ComputedBlocks:
        """Lookup only (no side effects: no reference taken, no stats): the longest cached
        prefix of full blocks of a sequence with no blocks, leaving at least one token to
        compute so logits exist. The admission commits it with :meth:`allocate_new_computed`
        (vLLM v1 ``get_computed_blocks`` / ``allocate_slots``), so a request that waits many
        steps for blocks is looked up many times but counted once."""
        if not self.enable_prefix_caching or self._tables.get(seq.seq_id):
            return ComputedBlocks()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent, extra = b"", self.extra_key(seq)
        blocks, hashes = [], []
        for i in range(max_blocks):
            h = hash_block(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size], extra)
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        return ComputedBlocks(tuple(blocks), tuple(hashes), len(blocks) * self.block_size)

    def allocate_new_computed(self, seq: Sequence, computed: ComputedBlocks | None, num_new_tokens: int) -> bool:
        """Admission of a sequence with no blocks: take the cached prefix ``computed`` (from
        :meth:`get_computed_blocks`; ``None`` = no lookup was made, e.g. prompt logprobs are
        wanted) and room for ``num_new_tokens`` tokens after it, then record the lookup in
        :attr:`prefix_stats` (``seq.num_tokens`` queried, the prefix hit; first admissions only). Returns False and
        changes nothing when the blocks do not fit (cached-but-free prefix blocks count as
        taken: reviving them removes them from the free queue)."""
        hit = computed or ComputedBlocks()
        revived = sum(1 for block in hit.block_ids if self.pool.ref_cnt[block] == 0)
        needed = self.blocks_for(hit.num_tokens + num_new_tokens) - len(hit.block_ids) + revived
        if needed > self.pool.num_free_blocks:
            return False
        for block in hit.block_ids:
            self.pool.incref(block)
        self._tables[seq.seq_id] = list(hit.block_ids)
        self._hashes[seq.seq_id] = list(hit.block_hashes)
        seq.num_computed_tokens = hit.num_tokens
        if computed is not None and self.enable_prefix_caching and seq.num_preemptions == 0:
            self.prefix_stats.queries_tokens += seq.num_tokens
            self.prefix_stats.hits_tokens += hit.num_tokens
        self.allocate_slots(seq, num_new_tokens)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that became full and computed in the last step."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.get(seq.seq_id)
        if hashes is None:
            hashes = self._hashes[seq.seq_id] = []
        if num_full <= len(hashes):
            return
        extra, table = self.extra_key(seq), self.block_ids(seq)
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else b""
            h = hash_block(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size], extra)
            hashes.append(h)
            if table[i] != NULL_BLOCK:  # already freed outside the window (async scheduling): not cached
                self.pool.set_hash(table[i], h)

    # -- swapping ---------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.swap_pool is not None and self.num_held_blocks(seq) <= self.swap_pool.num_free_blocks

    def swap_out(self, seq: Sequence) -> None:
        """Move ``seq``'s blocks to host swap blocks (copies recorded as pending; NULL entries stay NULL)."""
        assert self.swap_pool is not None
        host = []
        for block in self.block_ids(seq):
            if block == NULL_BLOCK:
                host.append(NULL_BLOCK)
                continue
            dst = self.swap_pool.allocate()
            self.pending.swap_out.append((block, dst))
            host.append(dst)
        hashes = self._hashes.get(seq.seq_id)
        self.free(seq)
        if hashes is not None:  # still valid once swapped back in
            self._hashes[seq.seq_id] = hashes
        self._swapped[seq.seq_id] = host

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for the swapped blocks plus those of ``num_new_tokens`` more tokens."""
        host = self._swapped[seq.seq_id]
        held = sum(1 for block in host if block != NULL_BLOCK)
        new = max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(host))
        return held + new <= self.pool.num_free_blocks

    def swap_in(self, seq: Sequence) -> None:
        table = self.block_ids(seq)
        for src in self._swapped.pop(seq.seq_id):
            if src == NULL_BLOCK:
                table.append(NULL_BLOCK)
                continue
            dst = self.pool.allocate()
            self.pending.swap_in.append((src, dst))
            self.swap_pool.free(src)
            table.append(dst)
        # Hashes stay valid only if re-registered on the new blocks.
        for block, h in zip(table, self.block_hashes(seq)):
            if block != NULL_BLOCK:
                self.pool.set_hash(block, h)

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self._swapped

    def release(self, seq: Sequence) -> None:
        """Give back everything ``seq`` holds: device blocks (:meth:`free`), host swap blocks
        and block hashes. Idempotent (a sequence holding nothing is left as it is)."""
        self.free(seq)
        for src in self._swapped.pop(seq.seq_id, []):
            if src != NULL_BLOCK:
                self.swap_pool.free(src)

    def take_pending(self) -> BlockCopies:
        """The block moves to perform before this step's forward; resets them."""
        pending, self.pending = self.pending, BlockCopies()
        return pending
