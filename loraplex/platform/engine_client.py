"""The engine surface the platform serves through (the gateway never touches an ``LLMEngine``).

Two implementations:

- :class:`~loraplex.platform.async_engine.AsyncEngine`: one engine in this process, run by a
  dedicated thread (``loraplex serve``).
- :class:`~loraplex.platform.cluster.client.ReplicaEngineClient`: N engine replicas as Ray
  Serve deployments behind an adapter-aware request router (``loraplex serve --replicas N``).

Routes, services and the console use only what :class:`EngineClient` lists, so auth, the
registry, quotas, admission and the console are the same in both modes.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from loraplex.engine.input_processor import ProcessedPrompt
    import torch

    from loraplex.adapters import BaseModelSpec
    from loraplex.adapters.lora_request import LoRARequest
    from loraplex.engine.fairness import TenantShare
    from loraplex.engine.input_processor import InputProcessor
    from loraplex.engine.outputs import RequestOutput
    from loraplex.engine.sampling_params import SamplingParams
    from loraplex.engine.structured_output import StructuredOutputManager


class EngineRequestStream(Protocol):
    """One engine request's outputs (async iterator; ends after the finished one).

    Raises the engine's failure (``EngineStoppedError``, ``QueueTimedOut``, a replica's
    ``ReplicaFailed``, ...). :meth:`close` aborts the request unless it finished.
    """

    request_id: str
    finished: bool

    def __aiter__(self) -> EngineRequestStream: ...

    async def __anext__(self) -> RequestOutput: ...

    def close(self) -> None: ...

    def fail(self, exc: BaseException) -> None:
        """Abort the request (unless it finished) and end the stream with ``exc``: outputs already delivered are
        read first, then ``__anext__`` raises ``exc`` (e.g. the server's shutdown grace has passed)."""
        ...


@runtime_checkable
class EngineClient(Protocol):
    """What the platform needs from the engine(s) it serves."""

    clock: Callable[[], float]
    """Monotonic seconds: the timeline of queueing deadlines (the admission gate uses it too)."""

    @property
    def tokenizer(self): ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def max_lora_rank(self) -> int: ...

    @property
    def max_full_module_slots(self) -> int:
        """Device slots for adapters' ``modules_to_save`` copies (``EngineConfig.max_full_module_slots``)."""
        ...

    @property
    def lora_enabled(self) -> bool: ...

    @property
    def model_name(self) -> str: ...

    @property
    def base_spec(self) -> BaseModelSpec: ...

    @property
    def vocab_size(self) -> int:
        """The model's logits width (token ids below it are valid in prompts)."""

    @property
    def input_processor(self) -> InputProcessor:
        """Prompt validation of the engine(s) (one owner: ``engine/input_processor.py``), run before queueing."""

    @property
    def serving_dtype(self) -> torch.dtype | None:
        """The dtype adapters are served in (None without LoRA)."""

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar compiler the API checks constraints with before queueing a request."""

    @property
    def is_running(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...

    async def add_request(self, request_id: str, prompt_token_ids: list[int] | ProcessedPrompt, params: SamplingParams,
                          lora_request: LoRARequest | None = None, *, tenant: TenantShare | None = None,
                          queue_deadline: float | None = None, retry_after_s: int = 1,
                          on_done: Callable[[], None] | None = None) -> EngineRequestStream: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]: ...

    def retire_lora(self, lora_int_id: int, on_released: Callable[[], None] | None = None) -> None: ...

    def preload_lora(self, lora_request: LoRARequest) -> concurrent.futures.Future: ...

    def stats_dict(self) -> dict[str, Any] | None: ...


async def generate_outputs(client: EngineClient, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                           lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
    """Every client's ``generate``: :meth:`EngineClient.add_request`, then its outputs until it finishes
    (the request aborted if the iterator is closed early)."""
    stream = await client.add_request(request_id, prompt_token_ids, params, lora_request)
    try:
        async for output in stream:
            yield output
    finally:
        stream.close()
