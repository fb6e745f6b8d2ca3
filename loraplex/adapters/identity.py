"""Content identity of an adapter: the ``version_id`` used in prefix-cache keys and the registry.

Semantics: ``version_id = sha256(tag || frame(canonical_config) || for name in sorted(tensors):
frame(json([name, dtype, shape])) || frame(raw_bytes))`` where ``frame(x) = len(x) as 8-byte
little-endian || x`` and ``canonical_config = json.dumps(config, sort_keys=True, separators=(",", ":"))``.

Length framing makes the byte stream unambiguous, so two different adapters cannot
produce the same input to sha256. The folder path is not hashed: the same files give
the same id wherever they live.

The stream is laid out in one buffer (``ContentStream``: the frames written, each tensor's bytes copied to its
place by the caller, e.g. a few batched copies) and hashed by one ``update``, which releases the GIL once:
hashing tensor by tensor released and re-took it per tensor, and a loader thread waits for each re-take while
the engine thread runs Python.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
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
    flat = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors.items()}
    stream = ContentStream(config, [(name, t.dtype, tuple(t.shape), t.numel() * t.element_size())
                                    for name, t in flat.items()])
    for name, tensor in flat.items():
        start = stream.offsets[name]
        stream.buffer[start : start + tensor.numel() * tensor.element_size()] = \
            tensor.reshape(-1).view(torch.uint8).numpy()
    return stream.hexdigest()


class ContentStream:
    """The byte stream ``version_id`` hashes, in one buffer, for ``tensors`` given as ``(name, stored dtype,
    shape, nbytes)`` in any order.

    - ``buffer``: ``[total] uint8``, the tag and frames written; the caller copies each tensor's raw bytes to
      ``buffer[offsets[name] : offsets[name] + nbytes]`` before ``hexdigest``.
    - ``offsets``: name -> byte offset of its raw bytes in ``buffer``.
    """

    def __init__(self, config: dict[str, Any], tensors: Iterable[tuple[str, torch.dtype, Sequence[int], int]]) -> None:
        frames: list[tuple[int, bytes]] = []  # (offset in the stream, bytes)
        head = _TAG + _framed(canonical_config_bytes(config))
        frames.append((0, head))
        end = len(head)
        self.offsets: dict[str, int] = {}
        for name, dtype, shape, nbytes in sorted(tensors, key=lambda entry: entry[0]):
            frame = _framed(json.dumps([name, str(dtype), list(shape)]).encode("utf-8")) + nbytes.to_bytes(8, "little")
            frames.append((end, frame))
            self.offsets[name] = end + len(frame)
            end += len(frame) + nbytes
        self.buffer = np.empty(end, dtype=np.uint8)
        view = memoryview(self.buffer)
        for start, frame in frames:
            view[start : start + len(frame)] = frame

    def hexdigest(self) -> str:
        """sha256 hex digest of ``buffer`` (the ``version_id``, once every tensor's bytes are in place)."""
        return hashlib.sha256(self.buffer).hexdigest()


def _framed(data: bytes) -> bytes:
    """``len(data)`` as 8 bytes little-endian, then ``data``."""
    return len(data).to_bytes(8, "little") + data
