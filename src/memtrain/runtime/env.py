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
from memtrain.config.run import ConfigError
from memtrain.devices.probe import cpu_model


def visible_gpus_phrase(count: int) -> str:
    """``"2 CUDA GPUs are visible"`` (``"1 CUDA GPU is visible"``): the refusals of a GPU that is not there."""
    return f"{count} CUDA GPU{'s are' if count != 1 else ' is'} visible"


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
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        # Else the first allocation there fails deep in the run with CUDA's "invalid device ordinal".
        count = torch.cuda.device_count()
        raise ConfigError(f"--device {name}: {visible_gpus_phrase(count)} "
                          f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''}); "
                          "CUDA_VISIBLE_DEVICES numbers the visible ones from 0")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def _checkout_root() -> Optional[Path]:
    """The memtrain source checkout this module runs from, or None when it is installed.

    The package folder (``src/memtrain``) sits two folders below a checkout's root, beside its
    ``pyproject.toml``. Anything else (a wheel in site-packages, a copy of the tree inside some
    other git repository) has no commit of memtrain's own to report.
    """
    package = Path(__file__).resolve().parents[1]  # src/memtrain, wherever this module sits in it
    root = package.parents[1]
    if (root / "pyproject.toml").is_file() and (root / "src" / "memtrain" / "__init__.py").is_file():
        return root
    return None


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                          timeout=5, check=True).stdout.strip()


@lru_cache(maxsize=1)
def git_commit() -> Optional[str]:
    """The commit of the memtrain checkout, with ``-dirty`` when it has local changes.

    Only a git repository whose top level is memtrain's own checkout counts: git would otherwise
    answer with the commit of whatever repository happens to contain the source tree. Where
    there is none, ``MEMTRAIN_COMMIT`` (set by a packager) or None, which reports say as unknown.
    """
    fallback = os.environ.get("MEMTRAIN_COMMIT") or None
    root = _checkout_root()
    if root is None:
        return fallback
    try:
        if Path(_git(root, "rev-parse", "--show-toplevel")).resolve() != root:
            return fallback
        sha = _git(root, "rev-parse", "--short=12", "HEAD")
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return fallback


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def device_model(device: torch.device) -> str:
    """The model of ``device``: the GPU's name as CUDA gives it ("NVIDIA H100 80GB HBM3"), the
    CPU's marketing name ("AMD EPYC 9B14"), where :func:`device_name` gives a CPU's core count only.
    Neither runs a kernel; on CUDA the name comes from the driver's properties."""
    return device_name(device) if device.type == "cuda" else cpu_model()


def environment(device: torch.device) -> dict[str, Any]:
    """What produced a result: device, software versions, commit."""

    env: dict[str, Any] = {
        "device": device_name(device),
        "device_model": device_model(device),
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
        env["allocator_conf"] = allocator_conf()
    return env


# The caching allocator's settings (torch 2.9 renamed the variable; the old name still counts).
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


def allocator_conf() -> dict[str, str]:
    """The allocator settings this process runs under, by variable ({}: torch's defaults). They
    change the reserved figures (``expandable_segments:True`` maps one growing segment instead of
    caching blocks; ``max_split_size_mb`` stops splits), and memtrain's allocator model assumes
    the defaults: a result records them so that its reserved figures are read for what they are."""
    return {name: os.environ[name] for name in ALLOC_CONF_VARS if os.environ.get(name)}
