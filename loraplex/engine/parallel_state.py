"""The tensor-parallel process group of one engine: the all-reduce after each row-parallel layer
and the driver's control channel to the other ranks (``torch.distributed``).

Backends:

- CPU: gloo for both (``all_reduce="auto"``).
- CUDA, ``all_reduce="symm_mem"`` (what ``"auto"`` means there): a one-shot all-reduce on
  symmetric memory (``torch.distributed._symmetric_memory``; about 16 µs per call between two
  H200s against 51-68 µs for an eager NCCL ``all_reduce``, see /work/shared/NOTES-gpu.md). The
  input is copied into a symmetric buffer and every rank sums all ranks' buffers (rank order, so
  every rank gets the same bits). Two buffers, used alternately by the callers (``o_proj`` buffer
  0, ``down_proj`` buffer 1), so a rank never overwrites a buffer a peer may still read: before
  it writes one again it has passed the barrier of the call in between, which the peer enters
  only after its read. No state changes per call, so it works inside CUDA graphs (fixed buffers).
  If symmetric memory cannot be set up, the engine refuses to start and names the
  ``tensor_parallel_all_reduce="nccl"`` setting; it never falls back by itself.
- CUDA, ``all_reduce="nccl"``: ``torch.distributed.all_reduce`` (NCCL), logged at start; decode
  steps then run eagerly (an NCCL all-reduce captured in a CUDA graph hung in an earlier test).

The control channel is a gloo group (on CUDA a second group beside NCCL): ``broadcast`` sends one
picklable object from rank 0 (the driver) to every rank, in program order.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Literal

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

AllReduceBackend = Literal["auto", "symm_mem", "nccl"]


class AllReduceUnavailableError(RuntimeError):
    """The asked all-reduce backend cannot run here; the message says which setting to change."""


class ParallelGroup:
    """Rank ``rank`` of a ``world_size``-process group (joined at construction, a collective).

    ``all_reduce(x [T, H], buffer) -> [T, H]``: the sum over ranks (``x`` may be overwritten); successive
    calls must alternate ``buffer`` 0 and 1 (the same sequence on every rank).
    ``max_numel``: the largest ``x.numel()`` (symmetric buffers are sized by it).

    Raises ``AllReduceUnavailableError`` for ``symm_mem`` where it cannot be set up, and for a
    CUDA backend on CPU.
    """

    def __init__(self, rank: int, world_size: int, init_method: str, device: torch.device,
                 all_reduce: AllReduceBackend, max_numel: int, dtype: torch.dtype) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        cuda = device.type == "cuda"
        if not cuda and all_reduce != "auto":
            raise AllReduceUnavailableError(
                f"tensor_parallel_all_reduce={all_reduce!r} needs CUDA devices; on CPU use 'auto' (gloo)")
        self.backend = ("symm_mem" if all_reduce == "auto" else all_reduce) if cuda else "gloo"
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, **({"device_id": device} if cuda else {}))
        self.group = dist.group.WORLD
        self.control = dist.new_group(backend="gloo") if cuda else self.group
        self._buffers: list[torch.Tensor] = []
        if self.backend == "symm_mem":
            self._buffers = self._symmetric_buffers(max_numel, dtype)
        if rank == 0:
            logger.info("tensor parallel: %d ranks, all-reduce %s%s", world_size, self.backend,
                        " (NCCL chosen explicitly: decode steps run eagerly)" if self.backend == "nccl" else "")

    def _symmetric_buffers(self, max_numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            with warnings.catch_warnings():  # needed by older torch versions, deprecated (a no-op) by newer ones
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
            buffer = symm_mem.empty(2 * max_numel, dtype=dtype, device=self.device)
            symm_mem.rendezvous(buffer, self.group.group_name)
        except Exception as exc:  # noqa: BLE001 - any failure is reported with the setting that avoids it
            raise AllReduceUnavailableError(
                f"symmetric-memory all-reduce unavailable ({type(exc).__name__}: {exc}); start with "
                f"tensor_parallel_all_reduce='nccl' (--tensor-parallel-all-reduce nccl) to use NCCL instead") from exc
        self.group_name = self.group.group_name
        return [buffer[:max_numel], buffer[max_numel:]]

    @property
    def captures_collectives(self) -> bool:
        """Whether decode CUDA graphs may capture the all-reduce (symmetric memory: yes; NCCL: not used)."""
        return self.backend == "symm_mem"

    def all_reduce(self, x: torch.Tensor, buffer: int) -> torch.Tensor:
        """Sum of ``x`` over the ranks, same shape and dtype (``buffer``: 0 or 1, see the class)."""
        if self.backend != "symm_mem":
            dist.all_reduce(x, group=self.group)
            return x
        buffer = self._buffers[buffer][: x.numel()]
        buffer.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buffer, "sum", self.group_name).view(x.shape)

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj``; every rank returns it (a collective on the control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_agree(self, flag: bool) -> bool:
        """True when ``flag`` is true on every rank (a collective on the control group)."""
        value = torch.tensor([1 if flag else 0])
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return bool(value.item())

    def close(self) -> None:
        """Leave the group (every rank must call it)."""
        self._buffers = []
        if dist.is_initialized():
            dist.destroy_process_group()
