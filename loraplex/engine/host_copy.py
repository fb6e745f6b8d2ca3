"""Host lists to device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and such a copy waits
for every kernel already queued on the stream: one call in a step's path stalls the host until
the previous step's GPU work ends, which undoes async scheduling (the host preparing step N+1
while the GPU runs step N). Host-to-device copies of the engine's step path go through
:func:`host_to_device` (lists) and :func:`tensor_to_device` (CPU tensors);
``tests/engine/test_host_copies.py`` scans ``loraplex/engine`` for the blocking forms
(``torch.tensor`` / ``torch.as_tensor`` with ``device=``, ``.cuda()``, ``.to(device)`` without
``non_blocking``) and allows only the load-time sites it lists.
"""

from __future__ import annotations

import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A 1-D (or nested-list) tensor of ``values`` with ``dtype`` on ``device``. To a CUDA device
    through pinned memory with a non-blocking copy (stream-ordered: kernels queued after it see
    the values); to any other device a plain copy."""
    return tensor_to_device(torch.tensor(values, dtype=dtype), device)


def tensor_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: to a CUDA device through pinned memory with a non-blocking
    copy (the pinned block is kept by torch's caching host allocator until the copy has run); to any
    other device a plain ``.to``."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
