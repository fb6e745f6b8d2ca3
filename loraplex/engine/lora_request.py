"""Re-export of :class:`loraplex.adapters.lora_request.LoRARequest` (its owner) for older imports."""

from loraplex.adapters.lora_request import LoRARequest

__all__ = ["LoRARequest"]
