"""The engine's name of a tenant's adapter version: one format, written and read here.

``engine_lora_name(3, "support", 2) == "3/support@2"``: the ``LoRARequest.lora_name`` the
platform gives the engine (unique per version; the tenant's id, not its name). The engine
reports adapters under this name (slot pool stats, per-adapter request counts), and the
metrics turn it back into the name a request's ``model`` field carries
(:func:`model_name_of`), as vLLM's ``vllm:lora_requests_info`` lists adapters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ENGINE_LORA_NAME = re.compile(r"^(\d+)/(.+)@(\d+)$")


@dataclass(frozen=True)
class EngineLoraName:
    """The parts of an engine lora name: tenant id, adapter name (the API's ``model``), version."""

    tenant_id: int
    name: str
    version: int


def engine_lora_name(tenant_id: int, name: str, version: int) -> str:
    """``"<tenant_id>/<name>@<version>"``."""
    return f"{tenant_id}/{name}@{version}"


def parse_engine_lora_name(lora_name: str) -> EngineLoraName | None:
    """The parts of ``lora_name``, or None when it is not in the platform's format
    (an adapter added to the engine by other means, e.g. the offline API)."""
    match = _ENGINE_LORA_NAME.match(lora_name)
    if match is None:
        return None
    return EngineLoraName(int(match.group(1)), match.group(2), int(match.group(3)))


def model_name_of(lora_name: str) -> str:
    """The ``model`` a request names the adapter by (``"3/support@2"`` -> ``"support"``);
    ``lora_name`` itself when it is not in the platform's format."""
    parts = parse_engine_lora_name(lora_name)
    return parts.name if parts is not None else lora_name
