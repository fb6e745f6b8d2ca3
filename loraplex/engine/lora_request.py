"""The per-request adapter selector, as in vLLM's ``LoRARequest``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Selects a LoRA adapter for a request.

    ``lora_name`` is a human name, ``lora_int_id`` a positive integer unique per
    adapter in this engine, ``lora_path`` a local folder holding a PEFT adapter
    (``adapter_config.json`` + ``adapter_model.safetensors``).

    Raises ``ValueError`` for a non-positive id or an empty name/path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r}: must be >= 1")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name: must not be empty")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path: must not be empty")
