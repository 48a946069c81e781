"""Host-to-device copies that do not stall the host."""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """Host values (a list or a numpy array) as a tensor on the device, without waiting.

    torch.tensor(values, device="cuda") copies from pageable memory and then synchronizes
    the stream, which stalls the host until the device has run everything queued before
    (the engine launches a step ahead). From pinned memory the copy is only queued."""
    device = torch.device(device)
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
