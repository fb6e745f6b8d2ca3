"""Host lists to device tensors without waiting for the device.

``torch.tensor(values, device="cuda")`` copies from pageable host memory, and such a copy waits
for every kernel already queued on the stream: one call in a step's path stalls the host until
the previous step's GPU work ends, which undoes async scheduling (the host preparing step N+1
while the GPU runs step N). Every host-to-device copy of the engine's step path goes through
:func:`host_to_device` (``tests/engine/test_host_copies.py`` checks that no module of
``loraplex/engine`` calls ``torch.tensor(..., device=...)``).
"""

from __future__ import annotations

import torch


def host_to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A 1-D (or nested-list) tensor of ``values`` with ``dtype`` on ``device``. To a CUDA device
    through pinned memory with a non-blocking copy (stream-ordered: kernels queued after it see
    the values); to any other device a plain copy."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
