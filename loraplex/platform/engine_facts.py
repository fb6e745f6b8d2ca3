"""What the gateway needs to know about a model whose engine runs in another process (Ray Serve
replicas: ``cluster/client.py``; one engine process: ``engine_process.py``): read from the model
folder and the engine's :class:`~loraplex.platform.cluster.replica.ReplicaInfo`, so prompts are
tokenized and validated, and structured-output constraints checked, in the gateway before a
request is sent (the engine side runs the same model and checks again)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from loraplex.adapters import BaseModelSpec
    from loraplex.engine.input_processor import InputProcessor
    from loraplex.engine.structured_output import StructuredOutputManager
    from loraplex.platform.cluster.replica import ReplicaInfo


class RemoteModelFacts:
    """The model-describing part of :class:`~loraplex.platform.engine_client.EngineClient` for an
    engine elsewhere. ``info``: the engine's description (model folder, context length, adapter
    limits and dtype). Loads the tokenizer and the model's spec from ``info.model_path``."""

    def __init__(self, info: ReplicaInfo) -> None:
        from transformers import AutoTokenizer

        from loraplex.engine.models.loader import load_model_spec

        self.info = info
        self._model_path = Path(info.model_path)
        self._tokenizer = AutoTokenizer.from_pretrained(str(self._model_path))
        self._spec = load_model_spec(self._model_path)
        self._input_processor: InputProcessor | None = None  # built on first use
        self._structured: StructuredOutputManager | None = None
        self._facts_lock = threading.Lock()

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_lora_rank(self) -> int:
        return self.info.max_lora_rank

    @property
    def max_full_module_slots(self) -> int:
        return self.info.max_full_module_slots

    @property
    def lora_enabled(self) -> bool:
        return self.info.lora_enabled

    @property
    def model_name(self) -> str:
        return self._model_path.name

    @property
    def base_spec(self) -> BaseModelSpec:
        """The engine's (``info.base_spec``: with tensor parallelism it refuses vocabulary adapters), else the
        model folder's."""
        return self.info.base_spec if self.info.base_spec is not None else self._spec.adapter_spec

    @property
    def vocab_size(self) -> int:
        return self._spec.vocab_size

    @property
    def input_processor(self) -> InputProcessor:
        """The engine's prompt validation, run here before a request is sent (same model, same rules)."""
        with self._facts_lock:
            if self._input_processor is None:
                from loraplex.engine.input_processor import InputProcessor

                self._input_processor = InputProcessor(self._tokenizer, self.vocab_size, self.max_model_len)
            return self._input_processor

    @property
    def serving_dtype(self) -> torch.dtype | None:
        import torch

        return getattr(torch, self.info.serving_dtype) if self.info.serving_dtype else None

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """A grammar compiler for this tokenizer (the API checks constraints with it; the engine
        compiles again for its own matchers)."""
        from loraplex.engine.structured_output import StructuredOutputManager

        with self._facts_lock:
            if self._structured is None:
                eos = set(self._spec.eos_token_ids) or {self._tokenizer.eos_token_id}
                self._structured = StructuredOutputManager(self._tokenizer, self._spec.vocab_size, sorted(eos))
            return self._structured
