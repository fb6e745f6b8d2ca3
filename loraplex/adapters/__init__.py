"""LoRA adapters: PEFT format loading and validation, content identity, and GPU slots.

Depends only on torch, safetensors, numpy and ``loraplex.adapters.lora_request``.
"""

from loraplex.adapters.adapter import AdapterInfo, LoRAAdapter, LoRAWeight
from loraplex.adapters.config import LoRAConfig
from loraplex.adapters.errors import (
    AdapterChangedError,
    AdapterConflictError,
    AdapterError,
    AdapterFormatError,
    AdapterIncompatibleError,
    AdapterNotServedError,
    AdapterUnsupportedError,
    NoFreeSlotError,
    SlotPoolError,
    UnknownAdapterError,
)
from loraplex.adapters.identity import compute_version_id
from loraplex.adapters.lora_request import LoRARequest
from loraplex.adapters.peft_format import (
    AdapterLayout,
    adapter_files_signature,
    inspect_peft_adapter,
    load_peft_adapter,
    validate_adapter_dir,
)
from loraplex.adapters.slot_pool import LoRASlotPool, SlotInfo, SlotPoolStats
from loraplex.adapters.slot_table import SlotTable
from loraplex.adapters.spec import LORA_MODULE_NAMES, BaseModelSpec

__all__ = [
    "LORA_MODULE_NAMES",
    "AdapterChangedError",
    "AdapterConflictError",
    "AdapterError",
    "AdapterFormatError",
    "AdapterIncompatibleError",
    "AdapterNotServedError",
    "AdapterInfo",
    "AdapterLayout",
    "AdapterUnsupportedError",
    "BaseModelSpec",
    "LoRAAdapter",
    "LoRAConfig",
    "LoRARequest",
    "LoRASlotPool",
    "LoRAWeight",
    "NoFreeSlotError",
    "SlotInfo",
    "SlotPoolError",
    "SlotPoolStats",
    "SlotTable",
    "UnknownAdapterError",
    "adapter_files_signature",
    "compute_version_id",
    "inspect_peft_adapter",
    "load_peft_adapter",
    "validate_adapter_dir",
]
