"""GPU names and how much memory each card has, without importing torch.

``memtrain estimate --gpu NAME`` and ``memtrain maxbatch --gpu NAME`` judge whether a training
step fits a card they may not run on; that needs the card's memory, and the analytic commands
stay torch-free. The figures and the names come from the one table of GPU kinds,
:mod:`memtrain.devices.gpu_kinds`, which :func:`memtrain.devices.gpus.lookup_gpu` (peak FLOP/s,
MFU) reads too.
"""

from __future__ import annotations

from typing import Optional

from memtrain.devices.gpu_kinds import GPU_KINDS, gpu_table_key

__all__ = ["GPU_MEMORY_BYTES", "MEASURED_MEMORY", "gpu_memory", "gpu_table_key"]

# Derived from the one table of GPU kinds (memtrain.devices.gpu_kinds): bytes per kind, None
# where one name covers two sizes (V100 16/32 GB; such a card needs --budget).
MEASURED_MEMORY = {key for key, kind in GPU_KINDS.items() if kind.memory_measured}
GPU_MEMORY_BYTES: dict[str, Optional[int]] = {key: kind.memory_bytes for key, kind in GPU_KINDS.items()}


def gpu_memory(name: Optional[str]) -> Optional[tuple[int, str]]:
    """(bytes, where the figure comes from) for a GPU name, or None when the table has no
    single figure for it (an unknown name, or a card sold in two sizes under one name)."""
    key = gpu_table_key(name)
    nbytes = GPU_MEMORY_BYTES.get(key) if key is not None else None
    if key is None or nbytes is None:
        return None
    source = (f"measured total_memory of an {GPU_KINDS[key].name}" if key in MEASURED_MEMORY
              else "datasheet capacity (the usable memory is lower: an H100 80GB reports 79.18 GiB)")
    return nbytes, f"{key}: {source}"
