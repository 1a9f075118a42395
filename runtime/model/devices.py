"""The few things the runtime does differently per device: waiting for it, and moving
small host tensors onto it without waiting.

Ascend NPUs are reached through `torch.npu`, which torch_npu registers when imported;
nothing here imports it.
"""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on an accelerator (a clock read before it would time
    only the launches); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host wait: an accelerator copies from pinned
    memory asynchronously (from pageable memory the copy may wait for the device's
    queue). On the CPU (and `meta`) a plain move."""
    if device.type in ("cuda", "npu") and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
