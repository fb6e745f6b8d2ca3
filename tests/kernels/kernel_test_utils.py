"""Independent float32 loops and helpers for the kernel tests.

The naive references here loop over tokens/positions with Python ints and
never call the ``*_ref`` functions, so they check the references too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loraplex.kernels.attention_metadata import AttentionMetadata
from loraplex.kernels.lora_expand import slot_rows_view

# (atol, rtol) per dtype. bf16/fp16 outputs are rounded once from fp32; the
# Triton CPU interpreter truncates fp32 -> bf16 instead of rounding to nearest,
# which can cost one more bf16 ulp.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

# One unit in the last place, relative: used for ops that must match HF's roundings.
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Finite and within the dtype's tolerance (times ``scale``) of ``expected``."""
    assert torch.isfinite(actual).all(), "output has NaN/Inf (not fully written?)"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol * scale, rtol=rtol * scale)


def assert_within_ulps(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: float, magnitude: torch.Tensor | None = None
) -> None:
    """``|actual - expected| <= ulps * ulp(dtype) * max(|expected|, magnitude, 1e-3)`` element-wise.

    ``magnitude`` bounds the terms an output is summed from (errors of a sum with
    cancellation scale with its terms, not with the result).
    """
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.isfinite(a).all(), "output has NaN/Inf (not fully written?)"
    scale = e.abs().clamp_min(1e-3)
    if magnitude is not None:
        scale = torch.maximum(scale, magnitude.float().cpu())
    worst = ((a - e).abs() - ulps * ULP[dtype] * scale).max().item()
    assert worst <= 0, f"max excess over {ulps} ulp: {worst}"


def assert_close_through(
    actual: torch.Tensor, op, sums: list[torch.Tensor], magnitudes: list[torch.Tensor], dtype: torch.dtype,
    ulps: float, scale: float = 1.0,
) -> None:
    """``actual`` against ``op(*sums)``, where each input ``sums[i]`` is a sum of terms of size ``magnitudes[i]``.

    A sum's rounding error scales with its terms, not with its value, and an op after a sum with cancellation
    carries that error on (silu(gate) * up: a gate near 0 off by 6e-5 of terms of 50 moves an output of 0.4 by
    more than 2e-5 of it; CI, 2026-12-03). Element-wise, first-order error propagation:

    ``|actual - op(sums)| <= atol + rtol |op(sums)| + ulps * ulp(dtype) * sum_i |J_i| @ magnitudes_i``

    (tolerances times ``scale``; ``J_i`` the Jacobian of ``op`` in ``sums[i]`` at ``sums``, flattened). The
    reference is ``op`` on CPU float32 copies, its result in float32; ``op`` must be differentiable by autograd.
    """
    inputs = tuple(s.detach().float().cpu() for s in sums)

    def reference(*xs: torch.Tensor) -> torch.Tensor:
        return op(*xs).float()

    expected = reference(*inputs).detach()
    jacobians = torch.autograd.functional.jacobian(reference, inputs)
    if not isinstance(jacobians, tuple):
        jacobians = (jacobians,)
    propagated = torch.zeros(expected.numel(), dtype=torch.float64)
    for jacobian, magnitude in zip(jacobians, magnitudes, strict=True):
        j = jacobian.reshape(expected.numel(), -1).double().abs()
        propagated += j @ magnitude.detach().double().cpu().flatten()
    _assert_within(actual, expected, ulps * ULP[dtype] * propagated.view(expected.shape).float(), dtype, scale)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """Same shape/dtype/device as ``t``, filled with NaN (output poisoning)."""
    return torch.full_like(t, float("nan"))


@dataclass
class PagedBatch:
    """A random paged KV cache plus the metadata of one step over it."""

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    meta: AttentionMetadata
    query: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    block_size: int


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_padded_tokens: int | None = None,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random caches with shuffled (non-contiguous) block tables; unused blocks hold random junk."""
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + spare_blocks
    ids = list(range(num_blocks))
    random.Random(torch.initial_seed()).shuffle(ids)
    tables, i = [], 0
    for n in needed:
        tables.append(ids[i : i + n])
        i += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, dtype=torch.float32).to(device=device, dtype=dtype)
    value_cache = torch.randn(shape, dtype=torch.float32).to(device=device, dtype=dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device, num_padded_tokens)
    num_tokens = meta.slot_mapping.shape[0]
    query = torch.randn((num_tokens, num_kv_heads * group, head_dim), dtype=torch.float32).to(device, dtype)
    return PagedBatch(key_cache, value_cache, meta, query, query_lens, seq_lens, tables, block_size)


def naive_paged_attention(batch: PagedBatch, scale: float, window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """Per-token, per-head float64 softmax over positions, reading the cache with Python block lookups;
    with a sliding ``window`` a query at position p sees positions ``max(0, p - window + 1) .. p``; with
    ``softcap`` the scores are ``softcap * tanh(scores / softcap)``."""
    q_all = batch.query.double().cpu()
    kc, vc = batch.key_cache.double().cpu(), batch.value_cache.double().cpu()
    num_q_heads, num_kv_heads = q_all.shape[1], kc.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros_like(q_all)
    t = 0
    for q_len, seq_len, table in zip(batch.query_lens, batch.seq_lens, batch.block_tables):
        for i in range(q_len):
            pos = seq_len - q_len + i
            seen = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            blocks = [table[p // batch.block_size] for p in seen]
            offsets = [p % batch.block_size for p in seen]
            k, v = kc[blocks, offsets], vc[blocks, offsets]  # [pos + 1, Hkv, D]
            for h in range(num_q_heads):
                scores = (k[:, h // group] @ q_all[t, h]) * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                weights = torch.exp(scores - scores.max())
                out[t, h] = (weights @ v[:, h // group]) / weights.sum()
            t += 1
    return out.float()


def naive_lora_shrink(x: torch.Tensor, lora_a: list[torch.Tensor], token_slots: torch.Tensor) -> torch.Tensor:
    """``v[i, t] = x[t] @ A_i[slot[t]].T`` per token in float32 (0 for slot -1)."""
    slots = token_slots.tolist()
    rank = lora_a[0].shape[1]
    v = torch.zeros((len(lora_a), len(slots), rank), dtype=torch.float32)
    for t, s in enumerate(slots):
        if s < 0:
            continue
        for i, a in enumerate(lora_a):
            v[i, t] = x[t].float().cpu() @ a[s].float().cpu().T
    return v


def naive_lora_expand(
    v: torch.Tensor, lora_b: list[torch.Tensor], scaling: list[torch.Tensor], y: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``y[t, slice_i] + scaling_i[s] * v[i, t] @ B_i[s].T`` per token in float32; returns a float32 copy."""
    return _expand_loop(v, lora_b, scaling, y, token_slots, lambda t: t)


def naive_lora_expand_magnitude(
    v: torch.Tensor, lora_b: list[torch.Tensor], scaling: list[torch.Tensor], y: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """``|scaling_i[s]| * |v[i, t]| @ |B_i[s]|.T`` (0 for tokens without adapter): the size of the delta's terms.

    An expand that rounds ``v`` to B's dtype before the dot (the kernels' and PEFT's semantics; the CPU
    interpreter truncates) errs by up to one ulp of that dtype times this, whatever the result's size: with
    cancellation the result can be near 0 while the error is not. (``y``'s own rounding is covered by
    :func:`assert_close`'s relative tolerance.)
    """
    return _expand_loop(v, lora_b, scaling, torch.zeros_like(y, dtype=torch.float32, device="cpu"), token_slots,
                        torch.abs)


def _expand_loop(v, lora_b, scaling, y, token_slots, f) -> torch.Tensor:
    """``f(y)[t, slice_i] + f(scaling_i[s]) * f(v[i, t]) @ f(B_i[s]).T`` per token in float32."""
    out = f(y.float().cpu().clone())
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        offset = 0
        for i, b in enumerate(lora_b):
            width = b.shape[1]
            scale = float(f(scaling[i][s].float().cpu()))
            out[t, offset : offset + width] += scale * (f(v[i, t].float().cpu()) @ f(b[s].float().cpu()).T)
            offset += width
    return out


def assert_lora_close(
    actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> None:
    """:func:`assert_close`'s tolerance plus one ulp of ``dtype`` times ``magnitude`` (the rounding of ``v``).

    ``magnitude`` comes from :func:`naive_lora_expand_magnitude`. One ulp, not more: a kernel that rounds
    ``v`` to a coarser dtype than B's (bf16 inside an fp16 expand) must fail.
    """
    _assert_within(actual, expected, ULP[dtype] * magnitude.float().cpu(), dtype, scale)


# A float32 sum taken in another order than the loop's (tiles, split-K, pages) errs by a few ulps of its terms on
# each side (the worst case grows with the term count).
SUM_ORDER_ULPS = 16


def assert_sum_close(
    actual: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> None:
    """:func:`assert_close`'s tolerance plus :data:`SUM_ORDER_ULPS` float32 ulps of ``terms``.

    ``terms`` bounds the summands of each output element (:func:`naive_lora_terms`,
    :func:`naive_lora_shrink_terms`): a float32 sum's rounding error scales with them, not with its value, so an
    output whose terms cancel is not held to a tolerance relative to itself (CI, 2026-12-03: a fresh seed's output
    of 0.4 off by 6e-5 of terms near 50).
    """
    _assert_within(actual, expected, SUM_ORDER_ULPS * ULP[torch.float32] * terms.float().cpu(), dtype, scale)


def _assert_within(actual, expected, extra: torch.Tensor, dtype: torch.dtype, scale: float) -> None:
    """``|actual - expected| <= atol + rtol |expected|`` (the dtype's tolerances times ``scale``) ``+ extra``,
    element-wise, ``actual`` finite."""
    a, e = actual.float().cpu(), expected.float().cpu()
    assert torch.isfinite(a).all(), "output has NaN/Inf (not fully written?)"
    atol, rtol = TOLERANCES[dtype]
    allowed = atol * scale + rtol * scale * e.abs() + extra
    excess = (a - e).abs() - allowed
    worst = int(excess.argmax())
    assert excess.max().item() <= 0, (
        f"max excess {excess.max().item():.3g} at flat index {worst}: actual {a.flatten()[worst].item():.6g} "
        f"expected {e.flatten()[worst].item():.6g}, allowed {allowed.flatten()[worst].item():.3g}"
    )


def naive_lora_shrink_terms(x: torch.Tensor, lora_a: list[torch.Tensor], token_slots: torch.Tensor) -> torch.Tensor:
    """``|x[t]| @ |A_i[slot[t]]|.T``: the size of the shrink's terms (0 for slot -1), float32 on CPU."""
    return naive_lora_shrink(x.abs(), [a.abs() for a in lora_a], token_slots)


def naive_lora_terms(
    x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], scaling: list[torch.Tensor],
    y: torch.Tensor, token_slots: torch.Tensor,
) -> torch.Tensor:
    """``|y| + |scaling_i[s]| (|x[t]| @ |A_i[s]|.T) @ |B_i[s]|.T``: the size of every term of ``y + x A^T B^T s``,
    the shrink's carried through B (its order differs too), float32 on CPU."""
    return naive_lora_expand(naive_lora_shrink_terms(x, lora_a, token_slots), [b.abs() for b in lora_b],
                             [s.abs() for s in scaling], y.abs(), token_slots)


def zipf_slots(num_tokens: int, num_slots: int, exponent: float = 1.5) -> torch.Tensor:
    """``[T] int32`` slots drawn from a Zipf-like law (slot 0 most popular), shuffled."""
    weights = torch.tensor([1.0 / (k + 1) ** exponent for k in range(num_slots)])
    return torch.multinomial(weights, num_tokens, replacement=True).to(torch.int32)


def folded_gemm(x: torch.Tensor, w: torch.Tensor, lora_a: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The shrink folded into the base GEMM, in the layout ``LinearWithLoRA.fold_lora_a`` builds: ``out = x @ [W; A_0
    (page-major); A_1; ...].T`` for ``lora_a`` ``n x [P, R, H]``. Returns ``(y, v)``: ``y`` the base columns (a
    row-strided view of ``out``, where an expand adds), ``v`` the ``[n, T, P, R]`` view of every page's shrink."""
    out = x @ torch.cat([w] + [a.reshape(-1, a.shape[-1]) for a in lora_a]).T
    return out[:, : w.shape[0]], slot_rows_view(out, w.shape[0], len(lora_a), *lora_a[0].shape[:2])
