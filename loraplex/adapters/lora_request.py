"""The per-request adapter selector, as in vLLM's ``LoRARequest``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_VERSION_ID = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class LoRARequest:
    """Selects a LoRA adapter for a request.

    ``lora_name`` is a human name, ``lora_int_id`` a positive integer unique per
    adapter in this engine, ``lora_path`` a local folder holding a PEFT adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``version_id`` (optional) declares the adapter's content id: the sha256 hex of
    ``loraplex.adapters.identity.compute_version_id`` over these files, computed
    once by the caller (the platform's registry ``content_hash``, whose folders are
    content-addressed and never change). With it, registration validates the config
    and the safetensors header only and the tensors are read at first use, never
    hashed by the engine; without it, registration reads and hashes every tensor.

    Raises ``ValueError`` for a non-positive id, an empty name/path, or a
    ``version_id`` that is not 64 lowercase hex digits.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    version_id: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r}: must be >= 1")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name: must not be empty")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path: must not be empty")
        if self.version_id is not None and not (
            isinstance(self.version_id, str) and _VERSION_ID.fullmatch(self.version_id)
        ):
            raise ValueError(
                f"LoRARequest.version_id={self.version_id!r}: must be a sha256 hex digest (64 lowercase hex digits)"
            )
