"""Megatron-style tensor parallelism over ``world_size`` ranks: which slice of each weight and of
each adapter a rank holds (Shoeybi et al. 2019, "Megatron-LM"; LoRA as S-LoRA and vLLM shard it).

Rank ``r`` of ``W`` ranks holds:

- column-parallel ``qkv_proj`` and ``gate_up_proj``: rows ``r/W .. (r+1)/W`` of *each* fused part
  (q, k, v by whole heads, so attention and the KV cache are split by KV head; gate and up), so
  its output is the local heads' q/k/v and the local part of the intermediate activation;
- row-parallel ``o_proj`` and ``down_proj``: columns ``r/W .. (r+1)/W`` of the weight; each rank's
  output is a partial sum, all-reduced after the layer (the bias, when there is one, added once
  after the reduction);
- everything else replicated: embeddings, norms, LM head, RoPE tables.

LoRA, matching: on a column-parallel layer ``A`` is whole (the shrink runs on the replicated
input) and ``B`` keeps the rank's output rows of each part; on a row-parallel layer ``A`` keeps
the rank's input columns and ``B`` is whole. Each rank's row-parallel LoRA delta
``scaling * (x_r @ A_r.T) @ B.T`` is then a partial sum like its base output, and the layer's one
all-reduce adds both: ``sum_r (x_r A_r^T) B^T = (sum_r x_r A_r^T) B^T``, the same as reducing the
rank-R partials before the expand (S-LoRA) with one collective instead of two (as vLLM's
``RowParallelLinearWithLoRA``).

A rank's model is the ordinary model of :func:`shard_spec`'s spec (heads, KV heads and the
intermediate size divided by ``W``), so attention, the KV cache and the LoRA slot tensors take
their per-rank shapes from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loraplex.adapters.device_weights import LoRADeviceWeights
from loraplex.adapters.errors import AdapterNotServedError
from loraplex.adapters.model_spec import ModelSpec
from loraplex.adapters.slot_image import SlotImage
from loraplex.adapters.spec import BaseModelSpec

_COLUMN_MODULES = ("qkv_proj", "gate_up_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_MODULES = ("o_proj", "down_proj")


class UnsupportedParallelismError(ValueError):
    """The model (or the engine configuration) cannot be split over the asked number of ranks;
    the message names the field and the values."""


@dataclass(frozen=True)
class TensorShard:
    """Which shard a process holds: ``rank`` of ``world_size``, of the model ``spec`` (full shapes)."""

    rank: int
    world_size: int
    spec: ModelSpec

    def shard_tensor(self, path: str, tensor: torch.Tensor, whole: bool) -> torch.Tensor:
        """This rank's slice of checkpoint tensor ``tensor`` for our parameter ``path``
        (``layers.3.self_attn.qkv_proj.weight``). ``whole``: ``tensor`` is the whole (fused)
        parameter; otherwise one of its parts (a split checkpoint's ``q_proj``). Replicated
        parameters come back as they are."""
        module, _, param = path.rpartition(".")
        name = module.rpartition(".")[2]
        if name in _ROW_MODULES and param == "weight":
            return tensor.chunk(self.world_size, dim=1)[self.rank]
        if name in _COLUMN_MODULES:
            sizes = self.fused_sizes(name) if whole else [tensor.shape[0]]
            return torch.cat([part.chunk(self.world_size, dim=0)[self.rank] for part in tensor.split(sizes, dim=0)])
        return tensor

    def full_shape(self, path: str, local_shape: torch.Size) -> tuple[int, ...]:
        """The unsharded shape of parameter ``path`` whose shard has ``local_shape``."""
        module, _, param = path.rpartition(".")
        name = module.rpartition(".")[2]
        shape = list(local_shape)
        if name in _ROW_MODULES and param == "weight":
            shape[1] *= self.world_size
        elif name in _COLUMN_MODULES:
            shape[0] *= self.world_size
        return tuple(shape)

    def fused_sizes(self, module: str) -> list[int]:
        """Full output sizes of the parts of ``module`` (q, k, v of ``qkv_proj``; gate, up of
        ``gate_up_proj``; one part otherwise)."""
        s = self.spec
        if module == "qkv_proj":
            return [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim]
        if module == "gate_up_proj":
            return [s.intermediate_size, s.intermediate_size]
        return [s.module_shapes[module][1]]

    def shard_slot_image(self, image: SlotImage, local_shapes: dict[str, tuple[int, int]]) -> SlotImage:
        """This rank's part of an adapter's slot image (full shapes): ``A`` whole and ``B``'s rows of each
        part on column-parallel modules; ``A``'s columns and ``B`` whole on row-parallel ones."""
        pieces: list[torch.Tensor] = []
        offsets: dict[tuple[int, str], tuple[int, int]] = {}
        numel = 0
        for key in image.offsets:  # in the image's (layer, module) order
            a, b = image.a(key), image.b_pages(key)  # [R, in], [pages, out, P]
            module = key[1]
            if module in _ROW_MODULES:
                a = a.chunk(self.world_size, dim=1)[self.rank]
            else:
                b = torch.cat([part.chunk(self.world_size, dim=1)[self.rank]
                               for part in b.split(self.fused_sizes(module), dim=1)], dim=1)
            offsets[key] = (numel, numel + a.numel())
            numel += a.numel() + b.numel()
            pieces += [a.reshape(-1), b.reshape(-1)]
        data = torch.cat(pieces) if pieces else image.data.new_empty(0)
        if image.data.is_pinned():
            data = data.pin_memory()
        return SlotImage(image.version_id, image.max_rank, data, offsets, image.scaling, dict(local_shapes),
                         page_rows=image.page_rows)


def shard_spec(spec: ModelSpec, world_size: int) -> ModelSpec:
    """The spec of one rank's model: query heads, KV heads and the intermediate size divided by
    ``world_size`` (head size, hidden size, vocabulary unchanged).

    Raises ``UnsupportedParallelismError`` when ``world_size`` does not divide the KV heads (the KV
    cache is split by KV head; KV heads are not replicated), the query heads or the intermediate size.
    """
    for field, value in (("num_key_value_heads", spec.num_kv_heads), ("num_attention_heads", spec.num_heads),
                         ("intermediate_size", spec.intermediate_size)):
        if value % world_size:
            raise UnsupportedParallelismError(
                f"tensor_parallel_size={world_size} does not divide the model's {field}={value}: attention and "
                f"the KV cache are split by KV head and the MLP by columns; use a tensor_parallel_size that "
                f"divides {field}")
    return dataclasses.replace(spec, num_heads=spec.num_heads // world_size,
                               num_kv_heads=spec.num_kv_heads // world_size,
                               intermediate_size=spec.intermediate_size // world_size)


class ShardedLoRADeviceWeights(LoRADeviceWeights):
    """One rank's LoRA slot tensors (per-rank shapes of ``shard_spec``): every write installs this rank's
    slice of the (full-shape) image. On the driver, ``forward_write`` / ``forward_disable`` pass each
    write and disable on to the other ranks, in order with the steps, so slots stay the same on all ranks
    (the driver's slot table decides; workers follow)."""

    def __init__(self, shard: TensorShard, local_spec: BaseModelSpec, num_slots: int, max_lora_rank: int,
                 dtype: torch.dtype, device: torch.device | str, forward_write=None, forward_disable=None, *,
                 page_rows: int | None = None, num_pages: int | None = None) -> None:
        # ``local_spec``: this rank's shapes of the served modules. No embed_tokens / lm_head LoRA or full-module
        # slots: not implemented with tensor parallelism (the pool refuses such adapters, naming it).
        super().__init__(dataclasses.replace(local_spec, vocab_size=None), num_slots, max_lora_rank,
                         dtype, device, page_rows=page_rows, num_pages=num_pages)
        self.shard = shard
        self.forward_write = forward_write
        self.forward_disable = forward_disable

    def check_dora(self, lora_name: str) -> None:
        """DoRA is refused with tensor parallelism: the column norm of a row-parallel layer (o_proj, down_proj)
        runs over every rank's input slice, which no rank holds at install."""
        reason = (f"a DoRA adapter (use_dora=true): DoRA is not served with "
                  f"tensor_parallel_size={self.shard.world_size} > 1 (the column norm of a row-parallel layer spans "
                  "every rank's weight slice); serve it with tensor_parallel_size=1")
        raise AdapterNotServedError(f"adapter {lora_name!r} is {reason}", reason)

    def write(self, slot: int, image: SlotImage, pages: tuple[int, ...]) -> None:
        super().write(slot, self.shard.shard_slot_image(image, self.spec.module_shapes), pages)
        if self.forward_write is not None:
            self.forward_write(slot, image, pages)

    def write_many(self, writes: list[tuple[int, SlotImage, tuple[int, ...]]], *, staging_bytes: int) -> None:
        super().write_many([(slot, self.shard.shard_slot_image(image, self.spec.module_shapes), pages)
                            for slot, image, pages in writes], staging_bytes=staging_bytes)
        if self.forward_write is not None:
            for slot, image, pages in writes:
                self.forward_write(slot, image, pages)

    def disable(self, slot: int) -> None:
        super().disable(slot)
        if self.forward_disable is not None:
            self.forward_disable(slot)
