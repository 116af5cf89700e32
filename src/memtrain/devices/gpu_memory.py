"""GPU names and how much memory each card has, without importing torch.

``memtrain estimate --gpu NAME`` and ``memtrain maxbatch --gpu NAME`` judge whether a training
step fits a card they may not run on; that needs the card's memory, and the analytic commands
stay torch-free. The name patterns are the ones :func:`memtrain.devices.gpus.lookup_gpu` (peak
FLOP/s, MFU) resolves names with: one table of GPU kinds, keyed alike.
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["GPU_MEMORY_BYTES", "MEASURED_MEMORY", "gpu_memory", "gpu_table_key"]

GiB = 1 << 30

# First match wins, so variants come before the bare model name. Patterns run on the
# lowercased name with punctuation turned into spaces, e.g. "nvidia a100 sxm4 80gb".
_PATTERNS: list[tuple[str, str]] = [
    (r"\bh100\b.*\bnvl\b", "h100-nvl"),
    (r"\bh100\b.*\bpcie\b", "h100-pcie"),
    (r"\bh100\b", "h100-sxm"),
    (r"\bh200\b.*\bnvl\b", "h200-nvl"),
    (r"\bh200\b", "h200"),
    (r"\ba100\b(?=.*\bpcie\b)(?=.*\b80\s*gb\b)", "a100-80gb-pcie"),
    (r"\ba100\b.*\bpcie\b", "a100-40gb-pcie"),
    (r"\ba100\b.*\b80\s*gb\b", "a100-80gb-sxm"),
    (r"\ba100\b", "a100-40gb-sxm"),
    (r"\ba10g\b", "a10g"),
    (r"\ba10\b", "a10"),
    (r"\bl40s\b", "l40s"),
    (r"\bl4\b", "l4"),
    # "rtx4090" (estimate --gpu's spelling) as well as "RTX 4090"; the China-market 4090 D is a
    # different part, as is the 3090 Ti.
    (r"(?:\b|(?<=rtx))4090\b(?!\s*d\b)", "rtx-4090"),
    (r"(?:\b|(?<=rtx))3090\b(?!\s*ti\b)", "rtx-3090"),
    (r"\bv100s\b", "v100s-pcie"),
    (r"\bv100\b.*\bpcie\b", "v100-pcie"),
    (r"\bv100\b", "v100-sxm2"),
    (r"\bt4\b", "t4"),
]

# Memory of each card, bytes. "h100-sxm" is MEASURED: torch.cuda.get_device_properties(0).total_memory
# of an "NVIDIA H100 80GB HBM3", less than the 80 GiB on its datasheet (the record it comes from:
# docs/estimation.md, ``budget_bytes``). The others are the DATASHEET capacity
# (the sources listed in memtrain.devices.gpus) read as GiB, an assumption: the driver keeps part
# of it, as the H100 shows. None: the datasheet lists two sizes under one name (V100 16/32 GB);
# such a card needs --budget.
MEASURED_MEMORY = {"h100-sxm"}
GPU_MEMORY_BYTES: dict[str, Optional[int]] = {
    "h100-sxm": 85_017_493_504,
    "h100-pcie": 80 * GiB,
    "h100-nvl": 94 * GiB,
    "h200": 141 * GiB,
    "h200-nvl": 141 * GiB,
    "a100-40gb-sxm": 40 * GiB,
    "a100-80gb-sxm": 80 * GiB,
    "a100-40gb-pcie": 40 * GiB,
    "a100-80gb-pcie": 80 * GiB,
    "a10": 24 * GiB,
    "a10g": 24 * GiB,
    "l4": 24 * GiB,
    "l40s": 48 * GiB,
    "rtx-4090": 24 * GiB,
    "rtx-3090": 24 * GiB,
    "v100-sxm2": None,
    "v100-pcie": None,
    "v100s-pcie": 32 * GiB,
    "t4": 16 * GiB,
}


def gpu_table_key(name: Optional[str]) -> Optional[str]:
    """The table key of a device name as ``torch.cuda.get_device_name`` gives it ("NVIDIA H100
    80GB HBM3", "Tesla T4") or a short name ("h100", "4090", "a100-80gb-pcie"); None when the
    name is not a known GPU (including "cpu")."""
    if not name:
        return None
    key = name.strip().lower()
    if key in GPU_MEMORY_BYTES:
        return key
    norm = re.sub(r"[^a-z0-9]+", " ", key).strip()
    for pattern, table_key in _PATTERNS:
        if re.search(pattern, norm):
            return table_key
    return None


def gpu_memory(name: Optional[str]) -> Optional[tuple[int, str]]:
    """(bytes, where the figure comes from) for a GPU name, or None when the table has no
    single figure for it (an unknown name, or a card sold in two sizes under one name)."""
    key = gpu_table_key(name)
    nbytes = GPU_MEMORY_BYTES.get(key) if key is not None else None
    if key is None or nbytes is None:
        return None
    source = ("measured total_memory of an H100 80GB HBM3" if key in MEASURED_MEMORY
              else "datasheet capacity (the usable memory is lower: an H100 80GB reports 79.18 GiB)")
    return nbytes, f"{key}: {source}"
