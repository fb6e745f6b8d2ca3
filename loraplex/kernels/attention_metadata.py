"""Per-step attention metadata shared by ``reshape_and_cache`` and ``paged_attention``.

One flattened batch holds B sequences; sequence b contributes
``q_len[b] = query_start_loc[b+1] - query_start_loc[b]`` query tokens this step
(1 for decode, the whole prompt or a chunk of it for prefill / chunked prefill /
extend after a prefix-cache hit). Its KV context after the step is
``seq_lens[b]`` positions::

    positions 0 ............................................ seq_lens[b]-1
    | cached prefix (already in the paged cache) | scheduled now (q_len[b]) |
                                                  ^ seq_lens[b] - q_len[b]

Query token i of sequence b sits at position ``seq_lens[b] - q_len[b] + i`` and
attends causally to positions <= its own. Position p of sequence b lives in
physical block ``block_tables[b, p // block_size]`` at offset
``p % block_size``; its flat cache slot is ``block * block_size + offset``.
Tokens ``t >= query_start_loc[B]`` are padding (slot -1, output zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from loraplex.kernels.errors import KernelArgumentError

_OP = "AttentionMetadata"


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """Where each query token and each KV position of one step live.

    Fields (device tensors on the model's device):

    - ``query_start_loc``: ``[B+1] int32``, cumulative query lengths (starts at 0).
    - ``seq_lens``: ``[B] int32``, context length after this step (cached + new tokens).
    - ``block_tables``: ``[B, max_blocks] int32``, physical block ids per sequence
      (with a sliding window, entries of blocks wholly before position ``seq_lens[b] - q_len[b] - W + 1``
      may be -1: freed blocks, never read by the kernels)
      (entries past ``cdiv(seq_lens[b], block_size)`` are ignored).
    - ``slot_mapping``: ``[T] int64``, flat cache slot of each token's new K/V; -1 = padding, skipped.
    - ``max_query_len`` / ``max_seq_len``: host ints, maxima of the query lengths / ``seq_lens``.
    - ``query_start_loc_host`` / ``seq_lens_host``: the same as host lists (reference path, launch sizing).

    Validated at construction from shapes and host lists only (no device sync);
    raises :class:`KernelArgumentError` naming the field and value.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_host: list[int]
    seq_lens_host: list[int]

    def __post_init__(self) -> None:
        self._check_tensors()
        self._check_host_lists()

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences in the step."""
        return len(self.seq_lens_host)

    @property
    def num_actual_tokens(self) -> int:
        """Query tokens that belong to a sequence (``query_start_loc[B]``); the rest are padding."""
        return self.query_start_loc_host[-1]

    @cached_property
    def has_decode_rows(self) -> bool:
        """Whether some sequence has exactly one query token (computed once per metadata, from host lists)."""
        qsl = self.query_start_loc_host
        return any(qsl[b + 1] - qsl[b] == 1 for b in range(self.num_seqs))

    @property
    def query_lens_host(self) -> list[int]:
        """``q_len[b]`` for every sequence, as a host list."""
        qsl = self.query_start_loc_host
        return [qsl[b + 1] - qsl[b] for b in range(self.num_seqs)]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str,
        num_padded_tokens: int | None = None,
    ) -> AttentionMetadata:
        """Build the metadata from host lists, computing ``slot_mapping`` with vectorised torch ops.

        ``block_tables[b]`` must hold at least ``cdiv(seq_lens[b], block_size)``
        block ids. ``num_padded_tokens`` (>= sum of ``query_lens``) appends
        padding tokens with slot -1, e.g. to reach a CUDA-graph batch size.

        Raises :class:`KernelArgumentError` for inconsistent lengths.
        """
        _check_build_args(query_lens, seq_lens, block_tables, block_size)
        num_tokens = sum(query_lens)
        total = num_tokens if num_padded_tokens is None else num_padded_tokens
        if total < num_tokens:
            raise KernelArgumentError(f"{_OP}.build: num_padded_tokens={total} < sum(query_lens)={num_tokens}")
        width = max([len(row) for row in block_tables] + [1])
        table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
        for b, row in enumerate(block_tables):  # one row per sequence, not per token
            table[b, : len(row)] = torch.tensor(list(row), dtype=torch.int32)
        qlens = torch.tensor(list(query_lens), dtype=torch.int64)
        slens = torch.tensor(list(seq_lens), dtype=torch.int64)
        seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens)), qlens)
        qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
        qsl[1:] = torch.cumsum(qlens, 0)
        index_in_query = torch.arange(num_tokens) - qsl[seq_of_token]
        positions = slens[seq_of_token] - qlens[seq_of_token] + index_in_query
        blocks = table[seq_of_token, positions // block_size].to(torch.int64)
        slots = torch.full((total,), -1, dtype=torch.int64)
        slots[:num_tokens] = blocks * block_size + positions % block_size
        return cls(
            query_start_loc=qsl.to(torch.int32).to(device),
            seq_lens=slens.to(torch.int32).to(device),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=list(seq_lens),
        )

    def _check_tensors(self) -> None:
        b = len(self.seq_lens_host)
        expected = {
            "query_start_loc": (self.query_start_loc, torch.int32, (b + 1,)),
            "seq_lens": (self.seq_lens, torch.int32, (b,)),
            "slot_mapping": (self.slot_mapping, torch.int64, None),
        }
        for name, (tensor, dtype, shape) in expected.items():
            if tensor.dtype != dtype:
                raise KernelArgumentError(f"{_OP}.{name}.dtype={tensor.dtype}, expected {dtype}")
            if shape is not None and tuple(tensor.shape) != shape:
                raise KernelArgumentError(f"{_OP}.{name}.shape={tuple(tensor.shape)}, expected {shape}")
        if self.slot_mapping.dim() != 1:
            raise KernelArgumentError(f"{_OP}.slot_mapping.shape={tuple(self.slot_mapping.shape)}, expected [T]")
        bt = self.block_tables
        if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != b:
            raise KernelArgumentError(
                f"{_OP}.block_tables: dtype={bt.dtype} shape={tuple(bt.shape)}, expected int32 [{b}, max_blocks]"
            )
        for name in ("seq_lens", "block_tables", "slot_mapping"):
            if getattr(self, name).device != self.query_start_loc.device:
                raise KernelArgumentError(
                    f"{_OP}.{name}.device={getattr(self, name).device}, "
                    f"expected {self.query_start_loc.device} (query_start_loc's)"
                )

    def _check_host_lists(self) -> None:
        qsl, sl = self.query_start_loc_host, self.seq_lens_host
        if len(qsl) != len(sl) + 1 or qsl[0] != 0:
            raise KernelArgumentError(
                f"{_OP}.query_start_loc_host={qsl}: expected {len(sl) + 1} cumulative offsets starting at 0"
            )
        qlens = self.query_lens_host
        for b, (q, s) in enumerate(zip(qlens, sl)):
            if q < 1 or s < q:
                raise KernelArgumentError(
                    f"{_OP}: sequence {b} has query_len={q}, seq_len={s}; need 1 <= query_len <= seq_len"
                )
        if self.max_query_len != max(qlens, default=0):
            raise KernelArgumentError(f"{_OP}.max_query_len={self.max_query_len}, expected {max(qlens, default=0)}")
        if self.max_seq_len != max(sl, default=0):
            raise KernelArgumentError(f"{_OP}.max_seq_len={self.max_seq_len}, expected {max(sl, default=0)}")
        if qsl[-1] > self.slot_mapping.shape[0]:
            raise KernelArgumentError(
                f"{_OP}.slot_mapping has {self.slot_mapping.shape[0]} entries < {qsl[-1]} query tokens"
            )


def _check_build_args(
    query_lens: Sequence[int], seq_lens: Sequence[int], block_tables: Sequence[Sequence[int]], block_size: int
) -> None:
    if block_size < 1:
        raise KernelArgumentError(f"{_OP}.build: block_size={block_size}, expected >= 1")
    if not len(query_lens) == len(seq_lens) == len(block_tables):
        raise KernelArgumentError(
            f"{_OP}.build: len(query_lens)={len(query_lens)}, len(seq_lens)={len(seq_lens)}, "
            f"len(block_tables)={len(block_tables)} must be equal"
        )
    for b, (s, row) in enumerate(zip(seq_lens, block_tables)):
        need = -(-s // block_size)
        if len(row) < need:
            raise KernelArgumentError(f"{_OP}.build: block_tables[{b}] has {len(row)} blocks, seq_len={s} needs {need}")
