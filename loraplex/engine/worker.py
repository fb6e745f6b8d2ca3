"""Tensor-parallel ranks: one process per rank; the scheduler runs in one place.

Rank 0 is the engine's own process (the *driver*): it schedules, owns the adapter slot table
and samples. Ranks 1..W-1 are worker processes (``spawn``) that each hold their shard of the model
(:mod:`loraplex.engine.tensor_parallel`), of the KV cache and of the LoRA slots, and follow the
driver's messages on the control channel, in order:

- ``_Init``: KV cache size, swap blocks, CUDA-graph sizes (sent once, after the driver sized the cache);
- a :class:`~loraplex.engine.step_plan.StepPlan`: run the forward pass of the step (the all-reduces
  inside it pair the ranks up); only the driver computes logits and samples;
- ``_LoRAWrite`` / ``_LoRADisable``: install this rank's slice of an adapter's slot image / zero a
  slot's scalings (the driver decided; slots, loads and pins stay the same on every rank);
- ``None``: leave.

Timeline of start-up (every rank): join the group -> build the model shard (+ LoRA slots) ->
driver sizes the KV cache and sends ``_Init`` -> allocate it -> capture decode graphs in lockstep
(the captures run all-reduces) -> agree that every rank has its graphs -> serve.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.adapters.slot_image import SlotImage
from loraplex.engine.config import EngineConfig, served_adapter_spec
from loraplex.engine.kv_cache import KVCache, KVCacheSizing
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.loader import build_model, load_model_spec
from loraplex.engine.parallel_state import ParallelGroup
from loraplex.engine.parent_watch import exit_when_parent_exits
from loraplex.engine.step_plan import StepPlan
from loraplex.engine.tensor_parallel import (ShardedLoRADeviceWeights, TensorShard, UnsupportedParallelismError,
                                              shard_spec)
from loraplex.kernels.lora_linear import fold_shrink_pays
from loraplex.kernels.ops import Kernels, default_backend

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Init:
    sizing: KVCacheSizing
    num_swap_blocks: int
    graphs: tuple | None  # ModelRunner.enable_cuda_graphs' arguments, None: eager


@dataclass(frozen=True)
class _LoRAWrite:
    slot: int
    image: SlotImage
    pages: tuple[int, ...]


@dataclass(frozen=True)
class _LoRADisable:
    slot: int


def check_tensor_parallel(config: EngineConfig, spec) -> None:
    """Refuse, before any process starts, what tensor parallelism cannot run: a size that does not divide
    the model's heads or intermediate size, more ranks than CUDA devices, a CUDA all-reduce on CPU.

    Raises ``UnsupportedParallelismError`` naming the setting and the values.
    """
    size = config.tensor_parallel_size
    shard_spec(spec, size)
    device = config.resolve_device()
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise UnsupportedParallelismError(
            f"tensor_parallel_size={size}: needs {size} CUDA devices, {torch.cuda.device_count()} visible")
    if device.type != "cuda" and config.tensor_parallel_all_reduce != "auto":
        raise UnsupportedParallelismError(
            f"tensor_parallel_all_reduce={config.tensor_parallel_all_reduce!r} needs CUDA devices; on CPU the "
            f"ranks all-reduce with gloo ('auto')")


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device of ``rank``: ``cuda:rank`` on CUDA, the CPU otherwise."""
    device = config.resolve_device()
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _max_all_reduce_numel(config: EngineConfig, hidden_size: int) -> int:
    """Largest all-reduce of one forward: one step's tokens (or a graph's batch) x hidden."""
    return max(config.max_num_batched_tokens, config.max_num_seqs) * hidden_size


class RankState:
    """What one rank holds: its group, shard, model, LoRA slot tensors (None without LoRA)."""

    def __init__(self, config: EngineConfig, model_path: Path, rank: int, init_method: str,
                 dummy_weights: bool, forward_write=None, forward_disable=None) -> None:
        self.device = rank_device(config, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = config.resolve_dtype(self.device)
        self.spec = load_model_spec(model_path)
        self.local_spec = shard_spec(self.spec, config.tensor_parallel_size)
        self.group = ParallelGroup(rank, config.tensor_parallel_size, init_method, self.device,
                                   config.tensor_parallel_all_reduce,
                                   _max_all_reduce_numel(config, self.spec.hidden_size), self.dtype)
        self.shard = TensorShard(rank, config.tensor_parallel_size, self.spec)
        torch.manual_seed(config.seed)
        self.model: LlamaForCausalLM = build_model(model_path, self.spec, self.dtype, self.device,
                                                   Kernels(default_backend(self.device)), dummy_weights,
                                                   config.seed, shard=self.shard)
        for layer in self.model.layers:  # the row-parallel layers, alternating the two all-reduce buffers
            layer.self_attn.o_proj.all_reduce = functools.partial(self.group.all_reduce, buffer=0)
            layer.mlp.down_proj.all_reduce = functools.partial(self.group.all_reduce, buffer=1)
        self.lora_weights = None
        if config.enable_lora:
            lora = config.lora_config(self.device)
            served = served_adapter_spec(config.lora_target_modules, self.local_spec, vocab=False)
            self.lora_weights = ShardedLoRADeviceWeights(self.shard, served, config.max_loras,
                                                         config.max_lora_rank, self.dtype, self.device,
                                                         forward_write, forward_disable, page_rows=lora.page_rows,
                                                         num_pages=lora.num_pages)
            bind_lora(self.model, self.lora_weights)


def bind_lora(model: LlamaForCausalLM, weights, fold_shrink: str = "off") -> bool:
    """Point every LoRA-capable linear of ``model`` at its slices of the adapter weight pool ``weights``
    (a ``LoRADeviceWeights``: pages, scalings, DoRA gains, ranks and page table). A linear whose modules the
    pool does not hold (``lora_target_modules``) stays unbound: it launches no LoRA kernel.

    ``fold_shrink`` (``EngineConfig.lora_fold_shrink``): "on" folds the shrink of every bound linear into its base
    GEMM (``LinearWithLoRA.fold_lora_a``; the pool's A pages become views of the folded weight), "auto" those
    where :func:`~loraplex.kernels.lora_linear.fold_shrink_pays` (of the pool's page rows), "off" none. A paged pool
    folds all its pages (each token's expand then reads its slot's pages through the page table). Returns whether
    any linear folded (the weights it replaced are free: on CUDA the caller returns them to the device before sizing
    the KV cache). An FP8 linear folds where its GEMM takes split activations (``LinearWithLoRA.can_fold_shrink``).
    Raises ``ValueError`` when folding is asked of a linear that cannot fold (a row-parallel linear, or an FP8 one
    without split activations)."""
    if fold_shrink not in ("on", "auto", "off"):
        raise ValueError(f"bind_lora: fold_shrink={fold_shrink!r}, expected 'on', 'auto' or 'off'")
    folded = False
    for layer, lin in model.lora_linears():
        if not all(m in weights.a[layer] for m in lin.module_names):
            assert not any(m in weights.a[layer] for m in lin.module_names), "fused linears are served whole"
            continue
        pages = [weights.a[layer][m] for m in lin.module_names]
        lora_rows = sum(a.shape[0] * a.shape[1] for a in pages)
        if fold_shrink == "on" or (fold_shrink == "auto" and lin.can_fold_shrink(pages[0].dtype)
                                   and fold_shrink_pays(sum(lin.out_sizes), lora_rows, weights.page_rows,
                                                        fp8=lin.qweight is not None)):
            for module, view in zip(lin.module_names, lin.fold_lora_a(pages)):
                weights.replace_a(layer, module, view)
            folded = True
        lin.bind_lora([weights.a[layer][m] for m in lin.module_names], [weights.b[layer][m] for m in lin.module_names],
                      [weights.scaling[layer][m] for m in lin.module_names],
                      weights.gain_columns(layer, lin.module_names), ranks=weights.ranks,
                      page_table=weights.page_table)
    return folded


class TensorParallelDriver:
    """Rank 0's side: starts the worker processes, joins the group with them and sends them every
    step, adapter write and the final stop. Not thread-safe: the engine's step loop calls it.

    Raises what rank 0's :class:`RankState` raises; a worker that fails at start makes the group's
    join fail or time out (the worker's exception is in its log).
    """

    def __init__(self, config: EngineConfig, model_path: Path, dummy_weights: bool) -> None:
        check_tensor_parallel(config, load_model_spec(model_path))
        self.config = config
        self.world_size = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = multiprocessing.get_context("spawn")
        self.workers = [context.Process(target=_worker_main, name=f"loraplex-tp-rank{rank}", daemon=True,
                                        args=(config, str(model_path), rank, init_method, dummy_weights))
                        for rank in range(1, self.world_size)]
        for process in self.workers:
            process.start()
        try:
            self.state = RankState(config, model_path, 0, init_method, dummy_weights,
                                   forward_write=self._send_lora_write, forward_disable=self._send_lora_disable)
        except BaseException:
            self._stop_workers(timeout_s=0)
            raise
        self.group = self.state.group
        self._closed = False

    @property
    def shard(self) -> TensorShard:
        return self.state.shard

    def start_workers(self, runner: ModelRunner, sizing: KVCacheSizing, num_swap_blocks: int,
                      graphs: tuple | None) -> None:
        """Send ``_Init``; capture the driver's decode graphs in lockstep with the workers' (``graphs``:
        ``(max_model_len, max_num_seqs, num_lora_slots)``, None for eager); drop them on every rank
        unless every rank has them. Then every step's plan goes to the workers (``runner.on_step``)."""
        if graphs is not None and not self.group.captures_collectives:
            graphs = None
        self.group.broadcast(_Init(sizing, num_swap_blocks, graphs))
        if graphs is not None:
            runner.enable_cuda_graphs(*graphs)
        _agree_on_graphs(self.group, runner)
        runner.on_step = self.group.broadcast

    def _send_lora_write(self, slot: int, image: SlotImage, pages: tuple[int, ...]) -> None:
        self.group.broadcast(_LoRAWrite(slot, image, pages))

    def _send_lora_disable(self, slot: int) -> None:
        self.group.broadcast(_LoRADisable(slot))

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.group.broadcast(None)
        self.group.close()
        self._stop_workers(timeout_s=30)

    def _stop_workers(self, timeout_s: float) -> None:
        for process in self.workers:
            process.join(timeout_s)
            if process.is_alive():
                process.terminate()
                process.join()


def _agree_on_graphs(group: ParallelGroup, runner: ModelRunner) -> None:
    if not group.all_agree(runner.graphs is not None) and runner.graphs is not None:
        logger.warning("tensor parallel: decode CUDA graphs missing on some rank; every rank runs eagerly")
        runner.graphs = None
    elif runner.graphs is not None and group.rank == 0:
        logger.info("tensor parallel: decode CUDA graphs captured with their all-reduces (%s)", group.backend)


def _worker_main(config: EngineConfig, model_path: str, rank: int, init_method: str, dummy_weights: bool) -> None:
    """A worker rank: build the shard, then follow the driver's messages until ``None``. Exits when the driver's
    process is gone (killed while the group formed or the model loaded: nothing else would end this one)."""
    exit_when_parent_exits(f"tensor-parallel rank {rank}")
    state = RankState(config, Path(model_path), rank, init_method, dummy_weights)
    group = state.group
    init: _Init | None = group.broadcast()
    if init is None:  # the driver failed after the group formed (e.g. KV cache too small) and closed it
        group.close()
        return
    kv_cache = KVCache(state.local_spec, init.sizing, state.dtype, state.device, init.num_swap_blocks)
    runner = ModelRunner(state.model, kv_cache, config.block_size, state.device)
    if init.graphs is not None:
        runner.enable_cuda_graphs(*init.graphs)
    _agree_on_graphs(group, runner)
    with torch.inference_mode():
        while (message := group.broadcast()) is not None:
            if isinstance(message, StepPlan):
                runner.forward(message)
            elif isinstance(message, _LoRAWrite):
                state.lora_weights.write(message.slot, message.image, message.pages)
            elif isinstance(message, _LoRADisable):
                state.lora_weights.disable(message.slot)
            else:
                raise TypeError(f"tensor-parallel worker {rank}: unexpected message {type(message).__name__}")
    runner.grammar_masks.close()
    group.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
