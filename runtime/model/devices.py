"""The few things the runtime does differently per device: waiting for it, and moving
small host tensors onto it without waiting.

Ascend NPUs are reached through `torch.npu`, which torch_npu registers when imported;
nothing here imports it.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on an accelerator (a clock read before it would time
    only the launches); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]


def host_int64(values: Sequence[int]) -> torch.Tensor:
    """A host int64 tensor of `values` (token ids, positions): built through a C array,
    about 7x faster than `torch.tensor` of a tuple of a few thousand Python ints (0.26 ms
    for a 2k-token prompt), host time during which an accelerator would wait for work."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a host wait: an accelerator copies from pinned
    memory asynchronously (from pageable memory the copy may wait for the device's
    queue). On the CPU (and `meta`) a plain move."""
    if device.type in ("cuda", "npu") and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_device_many(hosts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`to_device` of several small host int64 tensors in one copy: on an accelerator
    they are packed into one pinned buffer, moved at once and split into views there (a
    copy costs the host about as much to launch whatever its size, and these are a few
    KiB each). Elsewhere one plain move each."""
    if device.type not in ("cuda", "npu") or not hosts:
        return [host.to(device) for host in hosts]
    for i, host in enumerate(hosts):
        if host.dtype != torch.int64 or host.device.type != "cpu":
            raise ValueError(f"hosts[{i}]: expected a host int64 tensor, got {host.dtype}")
    return _move_packed(hosts, device, pin=True)


def _move_packed(hosts: list[torch.Tensor], device: torch.device, pin: bool) -> list[torch.Tensor]:
    sizes = [host.numel() for host in hosts]
    packed = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=pin)
    torch.cat([host.reshape(-1) for host in hosts], out=packed)
    moved = packed.to(device, non_blocking=pin)
    return [part.view(host.shape) for part, host in zip(moved.split(sizes), hosts, strict=True)]
