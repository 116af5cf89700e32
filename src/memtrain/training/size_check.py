"""Whether a model's shape can be built here, before any of it is built: its size within the
limits ``estimate`` uses, and its parameters (in FP32, as models are built) within the memory
this host lets the process use (physical RAM, or less under a cgroup limit) and the device's.
A typo such as ``--n-layers 1000000000`` is refused in a second instead of building layers for
minutes or ending in an allocator's failure (:func:`check_model_size`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from memtrain.analysis.limits import check_analytic_size
from memtrain.config.run import ConfigError, ModelConfig

BUILD_BYTES_PER_PARAM = 4  # models are built in FP32 on the host; bf16-pure casts afterwards

# Where the kernel says how much memory this process may use (Linux): the host's counts, then a
# cgroup's (container) limit and usage. Module constants so a test can point them at crafted readings.
MEMINFO = Path("/proc/meminfo")
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def _read_small(path: Path) -> Optional[str]:
    """The text of a small kernel file, or None where it is missing or unreadable."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def host_memory_bytes() -> Optional[int]:
    """The memory this process may use: physical RAM, or less under a cgroup (container) limit."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    for cgroup in (CGROUP_V2 / "memory.max", CGROUP_V1 / "memory.limit_in_bytes"):
        text = (_read_small(cgroup) or "").strip()
        if text.isdigit():
            limits.append(int(text))
    return min(limits) if limits else None


def _field_bytes(text: Optional[str], name: str, unit: int = 1) -> Optional[int]:
    """The number after ``name`` on its line of a ``key value`` file (meminfo, memory.stat)."""
    for line in (text or "").splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[0] == name and parts[1].isdigit():
            return int(parts[1]) * unit
    return None


def _cgroup_available(limit: Path, usage: Path, stat_file: Path, inactive: str) -> Optional[int]:
    """A cgroup's limit less its usage, its inactive page cache counted as free (the kernel
    reclaims it before failing an allocation); None without a numeric limit."""
    limit_text, usage_text = (_read_small(limit) or "").strip(), (_read_small(usage) or "").strip()
    if not (limit_text.isdigit() and usage_text.isdigit()):
        return None  # no cgroup here, or "max": no limit
    reclaimable = _field_bytes(_read_small(stat_file), inactive) or 0
    return max(0, int(limit_text) - int(usage_text) + reclaimable)


def host_available_bytes() -> Optional[int]:
    """The memory a new allocation on this host can get now: the kernel's ``MemAvailable``,
    less under a cgroup limit; the total (:func:`host_memory_bytes`) where neither is known.
    Other processes' memory is not available: checking against the total let a run that
    could not fit start and end in the allocator's failure."""
    readings = [
        _field_bytes(_read_small(MEMINFO), "MemAvailable", 1024),  # meminfo counts in kB
        _cgroup_available(CGROUP_V2 / "memory.max", CGROUP_V2 / "memory.current", CGROUP_V2 / "memory.stat",
                          "inactive_file"),
        _cgroup_available(CGROUP_V1 / "memory.limit_in_bytes", CGROUP_V1 / "memory.usage_in_bytes",
                          CGROUP_V1 / "memory.stat", "total_inactive_file"),
    ]
    known = [r for r in readings if r is not None]
    return min(known) if known else host_memory_bytes()


def _device_memory_bytes(device: Any) -> Optional[int]:
    """Total memory of a CUDA device (None on the CPU, where host memory is the limit)."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        # torch loads only for a CUDA device: the CLI runs these checks before any command
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(device).total_memory)
    return None


def model_parameters(m: ModelConfig) -> int:
    """The parameter count of the model ``m`` describes, from its shape (nothing is built)."""
    from memtrain.analysis.estimate.params import param_count  # torch-free arithmetic
    from memtrain.config.archs import GPT2_ARCH

    # memtrain.models imports torch: loaded only when a model is checked
    from memtrain.models.spec import cost_arch, is_gpt_preset

    arch = GPT2_ARCH if is_gpt_preset(m.model) else cost_arch(m.model)  # type: ignore[arg-type]
    return param_count(m, arch)[0]


def check_model_size(m: ModelConfig, device: Any = "cpu", precision: str = "fp32",
                     host_bytes_per_param: int = BUILD_BYTES_PER_PARAM) -> None:
    """Refuse a model that cannot be built here, before building any of it (see the module
    docstring). ``device``: where it will run (its memory is checked besides the host's);
    ``host_bytes_per_param``: what one parameter takes on the host (FP32 for a build; a
    checkpoint's model loaded in place holds its tensors in the dtype they were saved in)."""

    check_analytic_size(m)
    params = model_parameters(m)
    host = host_memory_bytes()
    need = params * host_bytes_per_param
    if host is not None and need > host:
        held = "in FP32" if host_bytes_per_param == 4 else f"at {host_bytes_per_param} bytes each"
        raise ConfigError(f"the model has {params:,} parameters, {need / 2**30:,.1f} GiB {held}, more than this "
                          f"machine's {host / 2**30:,.1f} GiB of memory; choose a smaller --n-layers/--d-model/"
                          "--d-ff/--vocab-size (memtrain estimate shows what a size needs)")
    on_device = _device_memory_bytes(device)
    weight_bytes = 2 if precision == "bf16-pure" else BUILD_BYTES_PER_PARAM
    if on_device is not None and params * weight_bytes > on_device:
        raise ConfigError(f"the model's {params:,} parameters take {params * weight_bytes / 2**30:,.1f} GiB, more than "
                          f"{device}'s {on_device / 2**30:,.1f} GiB; choose a smaller model "
                          "(memtrain plan finds what fits)")


# This process's resident memory (Linux); a module constant so a test can point it at a crafted reading.
STATM = Path("/proc/self/statm")


def own_resident_bytes() -> Optional[int]:
    """This process's resident memory now (``/proc/self/statm``'s second field, in pages);
    None where the kernel does not say (not Linux)."""
    fields = (_read_small(STATM) or "").split()
    if len(fields) < 2 or not fields[1].isdigit():
        return None
    return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")


def check_cpu_rank_count(nproc: int) -> None:
    """Refuse more CPU ranks than the host's available memory holds, before any starts.

    On CUDA the GPU count bounds ``--nproc-per-node``; on the CPU nothing did, and
    ``--nproc-per-node 1000`` started 1000 interpreters on the host until the kernel killed them
    (minutes of thrashing, then a silent end). Each rank imports torch and memtrain as this
    launcher has by now, so this process's own resident memory is a lower bound of what one rank
    takes, before any model: N of them must fit in what the host has available."""
    per_rank, available = own_resident_bytes(), host_available_bytes()
    if per_rank is None or available is None or nproc * per_rank <= available:
        return
    fits = max(1, available // per_rank)
    raise ConfigError(f"--nproc-per-node {nproc} starts {nproc} CPU ranks of at least {per_rank / 2**20:,.0f} MiB each "
                      f"(this launcher's own memory, before a model), {nproc * per_rank / 2**30:,.1f} GiB in all, "
                      f"but the host has {available / 2**30:,.1f} GiB available; use --nproc-per-node {fits} or fewer")
