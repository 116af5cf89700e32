"""Run environment: device choice, seeding, and the facts recorded with every result."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import torch

import memtrain
from memtrain.config import ConfigError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; an unavailable device is a user error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown --device {name!r}; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


@lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """The commit of the memtrain checkout, with ``-dirty`` when it has local changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("MEMTRAIN_COMMIT")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment(device: torch.device) -> dict[str, Any]:
    """What produced a result: device, software versions, commit."""

    env: dict[str, Any] = {
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "memtrain": memtrain.__version__,
        "commit": git_commit(),
        "host_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env
