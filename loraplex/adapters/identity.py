"""Content identity of an adapter: the ``version_id`` used in prefix-cache keys and the registry.

Semantics: ``version_id = sha256(tag || frame(canonical_config) || for name in sorted(tensors):
frame(json([name, dtype, shape])) || frame(raw_bytes))`` where ``frame(x) = len(x) as 8-byte
little-endian || x`` and ``canonical_config = json.dumps(config, sort_keys=True, separators=(",", ":"))``.

Length framing makes the byte stream unambiguous, so two different adapters cannot
produce the same input to sha256. The folder path is not hashed: the same files give
the same id wherever they live.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

_TAG = b"loraplex-adapter-v1\0"


def canonical_config_bytes(config: dict[str, Any]) -> bytes:
    """``adapter_config.json`` content as canonical JSON bytes (sorted keys, no whitespace)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("utf-8")


def compute_version_id(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 hex digest over the canonical config and the tensors as stored.

    ``tensors``: name -> CPU tensor in its stored dtype (not converted); names are hashed
    in sorted order with their dtype, shape and raw bytes.
    """
    digest = hashlib.sha256(_TAG)
    _update_framed(digest, canonical_config_bytes(config))
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        header = json.dumps([name, str(tensor.dtype), list(tensor.shape)]).encode("utf-8")
        _update_framed(digest, header)
        _update_framed(digest, tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _update_framed(digest: Any, data: Any) -> None:
    """Feed ``len(data)`` then ``data`` (bytes or a 1-D uint8 array) to ``digest``."""
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
