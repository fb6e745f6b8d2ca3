"""reshape_and_cache: Triton kernel and reference against a per-token Python loop."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.errors import KernelArgumentError
from loraplex.kernels.reshape_and_cache import RESHAPE_AND_CACHE, reshape_and_cache_ref

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 4, 3, 16


def _inputs(dtype: torch.dtype, device: torch.device):
    num_tokens = 9
    # Distinct random slots, a few -1 (padding) among them.
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE)[:num_tokens]
    slots[torch.tensor([1, 5])] = -1
    # key/value as strided views of a fused qkv projection output.
    qkv = torch.randn(num_tokens, 5 * NUM_KV_HEADS * HEAD_DIM).to(device=device, dtype=dtype)
    key = qkv[:, 2 * NUM_KV_HEADS * HEAD_DIM : 3 * NUM_KV_HEADS * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = qkv[:, 3 * NUM_KV_HEADS * HEAD_DIM : 4 * NUM_KV_HEADS * HEAD_DIM].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    shape = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape).to(device=device, dtype=dtype)
    value_cache = torch.randn(shape).to(device=device, dtype=dtype)
    return key, value, key_cache, value_cache, slots.to(device)


def _naive(key, value, key_cache, value_cache, slots):
    kc, vc = key_cache.clone(), value_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s // BLOCK_SIZE, s % BLOCK_SIZE] = key[t]
            vc[s // BLOCK_SIZE, s % BLOCK_SIZE] = value[t]
    return kc, vc


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_matches_naive_loop(kernel_device, triton_kernels, dtype):
    key, value, key_cache, value_cache, slots = _inputs(dtype, kernel_device)
    expected_k, expected_v = _naive(key, value, key_cache, value_cache, slots)
    triton_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)  # a copy: bit-exact, untouched slots unchanged
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reference_matches_naive_loop(dtype):
    key, value, key_cache, value_cache, slots = _inputs(dtype, torch.device("cpu"))
    expected_k, expected_v = _naive(key, value, key_cache, value_cache, slots)
    reshape_and_cache_ref(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_reference_rejects_out_of_range_slot():
    key, value, key_cache, value_cache, slots = _inputs(torch.float32, torch.device("cpu"))
    slots[0] = NUM_BLOCKS * BLOCK_SIZE
    with pytest.raises(KernelArgumentError, match="slot_mapping values span"):
        reshape_and_cache_ref(key, value, key_cache, value_cache, slots)


@pytest.mark.parametrize(
    ("field", "fragment"),
    [("slot_mapping", "slot_mapping.dtype"), ("value", "value.shape"), ("key_cache", "key_cache.dtype")],
)
def test_bad_arguments_raise_typed_errors(kernel_device, field, fragment):
    args = dict(
        zip(("key", "value", "key_cache", "value_cache", "slot_mapping"), _inputs(torch.float32, kernel_device))
    )
    bad = {
        "slot_mapping": args["slot_mapping"].to(torch.int32),
        "value": args["value"][:, :2],
        "key_cache": args["key_cache"].half(),
    }
    args[field] = bad[field]
    for fn in (RESHAPE_AND_CACHE.triton, reshape_and_cache_ref):
        with pytest.raises(KernelArgumentError, match=fragment):
            fn(**args)
