"""Peak throughput of common GPUs, and model FLOP utilization (MFU).

The figures (dense tensor-core peaks at boost clock by matmul type, memory bandwidth) and their
sources are in the one table of GPU kinds, :mod:`memtrain.devices.gpu_kinds` (torch-free);
:data:`PEAK_FLOPS` is its view by kind. This module adds what needs torch: the live device's
kind, and a torch dtype's matmul type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from memtrain.devices.gpu_kinds import GPU_KINDS, gpu_table_key, peak_of
from memtrain.techniques.facts import MATMUL_TYPES, matmul_type

__all__ = ["GpuSpec", "PEAK_FLOPS", "lookup_gpu", "device_gpu", "peak_flops", "mfu"]

DTYPES: tuple[str, ...] = MATMUL_TYPES


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's dense peak FLOP/s by dtype and its memory bandwidth (bytes/s)."""

    name: str
    flops: Mapping[str, float | None] = field(repr=False, hash=False)  # a dict: not hashable
    mem_bandwidth: float

    def peak(self, dtype: str | torch.dtype) -> float | None:
        """Dense peak FLOP/s for ``dtype`` (see ``peak_flops``)."""
        return peak_flops(self, dtype)


PEAK_FLOPS: dict[str, GpuSpec] = {key: GpuSpec(kind.name, dict(kind.flops), kind.mem_bandwidth)
                                  for key, kind in GPU_KINDS.items()}


def lookup_gpu(name: str | None) -> GpuSpec | None:
    """The spec for a device name as ``torch.cuda.get_device_name`` gives it ("NVIDIA H100
    80GB HBM3", "Tesla T4"), a short name ("h100", "4090", "a100-80gb-pcie"), or None when
    the device is unknown (including "cpu")."""
    if not name:
        return None
    key = gpu_table_key(name)
    return PEAK_FLOPS[key] if key is not None else None


def device_gpu(device: str | torch.device) -> GpuSpec | None:
    """The spec of a live CUDA device, or None (CPU, MPS, unknown GPU)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return lookup_gpu(torch.cuda.get_device_name(dev))


def _matmul_type(dtype: str | torch.dtype) -> str | None:
    """The matmul type of a torch dtype or a name (memtrain.techniques.facts.matmul_type)."""
    if isinstance(dtype, torch.dtype):
        return matmul_type(str(dtype).removeprefix("torch."))  # torch.bfloat16 -> "bfloat16"
    return matmul_type(str(dtype))


def peak_flops(gpu: GpuSpec | None, dtype: str | torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``gpu`` for the matmul type ``dtype`` (a precision name of the
    config such as "bf16" or "bf16-pure", or a torch dtype), None if unknown.

    "tf32" on a GPU without TF32 tensor cores falls back to the FP32 rate, because that is
    what such a GPU runs when TF32 is requested.
    """
    if gpu is None:
        return None
    kind = _matmul_type(dtype)
    if kind is None:
        raise ValueError(f"unknown dtype {dtype!r} for peak FLOP/s; use one of {', '.join(DTYPES)}")
    return peak_of(gpu.flops, kind)


def mfu(
    flops_per_step: float, step_time_s: float, gpu: GpuSpec | None, dtype: str | torch.dtype
) -> float | None:
    """Model FLOP utilization: achieved FLOP/s (``flops_per_step / step_time_s``) over the
    GPU's dense peak for ``dtype``. None where the peak is unknown (CPU, unlisted GPU, a type
    the GPU has no tensor cores for)."""
    if step_time_s <= 0:
        raise ValueError(f"step time must be positive, got {step_time_s}")
    if flops_per_step < 0:
        raise ValueError(f"FLOPs per step must be non-negative, got {flops_per_step}")
    peak = peak_flops(gpu, dtype)
    if not peak:
        return None
    return flops_per_step / step_time_s / peak
