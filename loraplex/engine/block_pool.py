"""Physical KV block ids, reference counts and the prefix-hash map.

Owns nothing but integers: it never imports torch. The KV tensors themselves
live in :mod:`loraplex.engine.kv_cache`; this module only decides which
physical block holds what.

Free blocks wait in one LRU queue. A freed block whose content hash is known
stays *cached*: it is still in the hash map and can be revived by a prefix hit
until allocation takes it from the front of the queue (oldest-freed first).
Callers free a request's blocks deepest-first, so that for equal age the
deeper block of a chain is evicted first (vLLM v1 ``FreeKVCacheBlockQueue``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation is attempted with no free block left."""


@dataclass(frozen=True)
class BlockPoolStats:
    """Block accounting. ``used`` blocks have references; ``cached`` are free
    but still hold a hashed prefix; ``free`` hold nothing reusable."""

    num_blocks: int
    used: int
    cached: int
    free: int


class BlockPool:
    """Allocator of ``num_blocks`` physical KV blocks.

    Invariants: every block is either referenced (``ref_cnt > 0``) or in the
    free queue, never both; a hash maps to exactly one block and back.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool.num_blocks={num_blocks}: must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}

    # -- allocation -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free and cached-but-unreferenced)."""
        return len(self._free)

    def allocate(self) -> int:
        """Take the least recently freed block (evicting its cached hash).

        Raises:
            NoFreeBlocksError: every block is referenced.
        """
        if not self._free:
            raise NoFreeBlocksError("no free KV block")
        block, _ = self._free.popitem(last=False)
        self._evict_hash(block)
        self.ref_cnt[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference (fork or prefix hit); revives a cached free block."""
        if self.ref_cnt[block] == 0:
            del self._free[block]
        self.ref_cnt[block] += 1

    def free(self, block: int) -> None:
        """Drop one reference; at zero the block joins the back of the free queue.

        Raises:
            ValueError: the block has no reference (double free).
        """
        if self.ref_cnt[block] <= 0:
            raise ValueError(f"double free of KV block {block}")
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self._free[block] = None

    # -- prefix hashes ----------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The block that holds ``block_hash``'s content, if still cached."""
        return self._hash_to_block.get(block_hash)

    def set_hash(self, block: int, block_hash: bytes) -> None:
        """Record that a full, referenced block holds ``block_hash``'s content.

        A hash that is already held by another block is left with that block
        (the new block then just stays unshared).
        """
        if block_hash in self._hash_to_block or block in self._block_to_hash:
            return
        self._hash_to_block[block_hash] = block
        self._block_to_hash[block] = block_hash

    def block_hash(self, block: int) -> bytes | None:
        return self._block_to_hash.get(block)

    def _evict_hash(self, block: int) -> None:
        block_hash = self._block_to_hash.pop(block, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]

    # -- introspection ----------------------------------------------------
    def free_queue_order(self) -> list[int]:
        """Free block ids in eviction order (first = next to be taken)."""
        return list(self._free)

    def stats(self) -> BlockPoolStats:
        cached = sum(1 for b in self._free if b in self._block_to_hash)
        free = len(self._free)
        return BlockPoolStats(self.num_blocks, self.num_blocks - free, cached, free - cached)
