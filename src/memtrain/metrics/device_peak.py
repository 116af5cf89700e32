"""The device allocator's own peaks (CUDA): what ``torch.cuda.max_memory_*`` reports.

They include the caching allocator's rounding and cached segments, which the tracked meter
(:mod:`memtrain.metrics.memory`) deliberately does not count.
"""

from __future__ import annotations

import torch

__all__ = ["device_peak_memory", "reset_device_peak"]


def device_peak_memory(device: str | torch.device) -> dict[str, int | None]:
    """The device allocator's peaks since the last reset: ``max_allocated_bytes`` and
    ``max_reserved_bytes`` on CUDA (ROCm included); None for both elsewhere, where torch keeps no
    such counters."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return {
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated(dev)),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved(dev)),
        }
    return {"max_allocated_bytes": None, "max_reserved_bytes": None}


def reset_device_peak(device: str | torch.device) -> None:
    """Restart the device allocator's peak counters (no-op off CUDA)."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        # Let queued kernels finish first, so their allocations land before the reset.
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
