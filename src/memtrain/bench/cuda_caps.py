"""A CUDA device's capabilities, learned in a short child process so the bench runner never
initialises CUDA itself.

The runner needs them before any row runs (which precisions are native; the GPU's model for the
bench settings), but torch answers only after initialising CUDA in the asking process:
``torch.cuda.get_device_capability``, ``get_device_name``, ``current_device`` and the CUDA RNG
state that ``probe`` saves all call ``torch.cuda._lazy_init``. A runner that did so would keep
CUDA state (and, once anything touches the device, a context holding GPU memory) for the whole
bench, beside every row it measures. The child's goes when it exits, before the first row.

Run as ``python -m memtrain.bench.cuda_caps cuda[:N]``: prints :class:`DeviceCaps` as one JSON line.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from typing import Optional

import torch

from memtrain.devices.probe import DeviceCaps, probe

__all__ = ["cuda_caps_in_child", "main"]

# A child imports torch and reads the driver's properties: seconds, even on a loaded machine.
CHILD_TIMEOUT_S = 180.0


@functools.lru_cache(maxsize=None)
def _child_answer(device: str) -> Optional[DeviceCaps]:
    """The child's answer for ``device`` (memoized: the settings and the row adaptation both ask)."""
    cmd = [sys.executable, "-m", "memtrain.bench.cuda_caps", device]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return None
    try:
        return DeviceCaps(**json.loads(lines[-1]))
    except (ValueError, TypeError):  # not the JSON of a DeviceCaps: a torch that printed after it
        return None


def cuda_caps_in_child(device: torch.device) -> Optional[DeviceCaps]:
    """``probe(device, measure=False, kernels=False)`` for a CUDA ``device``, run in a child
    process (None when it fails: the rows then run as listed, each probing itself)."""
    return _child_answer(str(device))


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].startswith("cuda"):
        print("usage: python -m memtrain.bench.cuda_caps cuda[:N]", file=sys.stderr)
        return 2
    caps = probe(torch.device(args[0]), measure=False, kernels=False)
    print(json.dumps(caps.to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
