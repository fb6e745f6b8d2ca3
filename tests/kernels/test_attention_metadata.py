"""AttentionMetadata: construction, derived values and validation."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.errors import KernelArgumentError


def test_build_computes_slots_from_positions_and_block_tables():
    # seq 0: 3 new tokens after 2 cached (positions 2, 3, 4); seq 1: decode at position 5; bs = 4.
    meta = AttentionMetadata.build([3, 1], [5, 6], [[7, 2], [4, 9]], 4, "cpu", num_padded_tokens=6)
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 6]
    assert meta.slot_mapping.tolist() == [7 * 4 + 2, 7 * 4 + 3, 2 * 4 + 0, 9 * 4 + 1, -1, -1]
    assert meta.block_tables.tolist() == [[7, 2], [4, 9]]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs, meta.num_actual_tokens) == (3, 6, 2, 4)
    assert meta.query_lens_host == [3, 1]
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert meta.slot_mapping.dtype == torch.int64


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"query_lens": [3], "seq_lens": [2]}, "query_len=3, seq_len=2"),
        ({"query_lens": [0], "seq_lens": [2]}, "query_len=0"),
        ({"block_tables": [[1]], "seq_lens": [5], "query_lens": [1]}, "needs 2"),
        ({"block_size": 0}, "block_size=0"),
        ({"num_padded_tokens": 1}, "num_padded_tokens=1"),
    ],
)
def test_build_rejects_inconsistent_input(kwargs, fragment):
    args = {"query_lens": [2], "seq_lens": [2], "block_tables": [[0]], "block_size": 4, "device": "cpu"}
    args.update(kwargs)
    with pytest.raises(KernelArgumentError, match=fragment):
        AttentionMetadata.build(**args)


def test_constructor_checks_dtypes_and_host_lists():
    meta = AttentionMetadata.build([2], [3], [[0]], 4, "cpu")
    fields = dict(vars(meta))
    with pytest.raises(KernelArgumentError, match="seq_lens.dtype"):
        AttentionMetadata(**{**fields, "seq_lens": meta.seq_lens.long()})
    with pytest.raises(KernelArgumentError, match="max_query_len=5"):
        AttentionMetadata(**{**fields, "max_query_len": 5})
    with pytest.raises(KernelArgumentError, match="query_start_loc_host"):
        AttentionMetadata(**{**fields, "query_start_loc_host": [1, 2]})
