"""Peak throughput of common GPUs, and model FLOP utilization (MFU).

All FLOP/s figures are *dense* (NVIDIA datasheets headline 2:4 structured-sparsity numbers,
twice the dense ones; a training step gets none of that) tensor-core peaks at boost clock.
Half precision is the rate with FP32 accumulation, which is what PyTorch's matmuls use; on
GeForce cards it is half the FP16-accumulate rate the marketing quotes. ``fp32`` is the plain
(non-tensor-core) FP32 rate; ``tf32`` the TF32 tensor-core rate. ``None`` means the hardware
has no tensor-core path for that type (BF16 and TF32 before Ampere).

Sources (dense figures, sparse ones halved where only those are printed):
- Hopper: "NVIDIA H100 Tensor Core GPU Architecture" whitepaper (H100 SXM5 / PCIe tables) and
  the H100 and H200 datasheets (NVL variants, H200 memory bandwidth).
- A100: "NVIDIA A100 Tensor Core GPU" datasheet (40GB/80GB, SXM/PCIe bandwidths).
- L4, L40S, A10, T4, V100: their NVIDIA datasheets.
- RTX 4090: "NVIDIA Ada GPU Architecture" whitepaper, appendix table for GeForce RTX 4090.
- RTX 3090: "NVIDIA Ampere GA102 GPU Architecture" whitepaper, GeForce RTX 3090 table.
- A10G: AWS-only part without an NVIDIA datasheet; figures as compared against the A10 in
  Baseten's "NVIDIA A10 vs A10G for ML model inference" (same 600 GB/s memory, half the
  A10's tensor rate, a higher FP32 rate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memtrain.devices.gpu_memory import gpu_table_key

__all__ = ["GpuSpec", "PEAK_FLOPS", "lookup_gpu", "device_gpu", "peak_flops", "mfu"]

DTYPES: tuple[str, ...] = ("bf16", "fp16", "tf32", "fp32")

T = 1e12  # TFLOP/s
GBs = 1e9  # GB/s (decimal, as datasheets state bandwidth)


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model's dense peak FLOP/s by dtype and its memory bandwidth (bytes/s)."""

    name: str
    flops: Mapping[str, float | None] = field(repr=False, hash=False)  # a dict: not hashable
    mem_bandwidth: float

    def peak(self, dtype: str | torch.dtype) -> float | None:
        """Dense peak FLOP/s for ``dtype`` (see ``peak_flops``)."""
        return peak_flops(self, dtype)


def _spec(name: str, bf16: float | None, fp16: float | None, tf32: float | None, fp32: float,
          bandwidth: float) -> GpuSpec:
    return GpuSpec(name, {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}, bandwidth)


PEAK_FLOPS: dict[str, GpuSpec] = {
    # Hopper. SXM5: 132 SMs at 1.83 GHz; PCIe: 114 SMs at 1.755 GHz (whitepaper).
    "h100-sxm": _spec("H100 SXM", 989.4 * T, 989.4 * T, 494.7 * T, 66.9 * T, 3350 * GBs),
    "h100-pcie": _spec("H100 PCIe", 756.0 * T, 756.0 * T, 378.0 * T, 51.2 * T, 2000 * GBs),
    "h100-nvl": _spec("H100 NVL", 835.5 * T, 835.5 * T, 417.5 * T, 60.0 * T, 3900 * GBs),
    # H200 is the H100 SXM die with 141 GB of HBM3e.
    "h200": _spec("H200 SXM", 989.4 * T, 989.4 * T, 494.7 * T, 66.9 * T, 4800 * GBs),
    "h200-nvl": _spec("H200 NVL", 835.5 * T, 835.5 * T, 417.5 * T, 60.0 * T, 4800 * GBs),
    # Ampere data centre.
    "a100-40gb-sxm": _spec("A100 40GB SXM", 312 * T, 312 * T, 156 * T, 19.5 * T, 1555 * GBs),
    "a100-80gb-sxm": _spec("A100 80GB SXM", 312 * T, 312 * T, 156 * T, 19.5 * T, 2039 * GBs),
    "a100-40gb-pcie": _spec("A100 40GB PCIe", 312 * T, 312 * T, 156 * T, 19.5 * T, 1555 * GBs),
    "a100-80gb-pcie": _spec("A100 80GB PCIe", 312 * T, 312 * T, 156 * T, 19.5 * T, 1935 * GBs),
    "a10": _spec("A10", 125 * T, 125 * T, 62.5 * T, 31.2 * T, 600 * GBs),
    "a10g": _spec("A10G", 70 * T, 70 * T, 35 * T, 35 * T, 600 * GBs),
    # Ada data centre.
    "l4": _spec("L4", 121 * T, 121 * T, 60 * T, 30.3 * T, 300 * GBs),
    "l40s": _spec("L40S", 362.05 * T, 362.05 * T, 183 * T, 91.6 * T, 864 * GBs),
    # GeForce (FP32-accumulate tensor rates).
    "rtx-4090": _spec("RTX 4090", 165.2 * T, 165.2 * T, 82.6 * T, 82.6 * T, 1008 * GBs),
    "rtx-3090": _spec("RTX 3090", 71 * T, 71 * T, 35.6 * T, 35.6 * T, 936 * GBs),
    # Volta and Turing: FP16 tensor cores only.
    "v100-sxm2": _spec("V100 SXM2", None, 125 * T, None, 15.7 * T, 900 * GBs),
    "v100-pcie": _spec("V100 PCIe", None, 112 * T, None, 14 * T, 900 * GBs),
    "v100s-pcie": _spec("V100S PCIe", None, 130 * T, None, 16.4 * T, 1134 * GBs),
    "t4": _spec("T4", None, 65 * T, None, 8.1 * T, 320 * GBs),
}

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


_DTYPE_ALIASES: dict[Any, str] = {
    "bf16": "bf16", "bfloat16": "bf16", "bf16-pure": "bf16", "bf16-mixed": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "fp16-mixed": "fp16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
}


def peak_flops(gpu: GpuSpec | None, dtype: str | torch.dtype) -> float | None:
    """Dense peak FLOP/s of ``gpu`` for the matmul type ``dtype`` (a precision name of the
    config such as "bf16" or "bf16-pure", or a torch dtype), None if unknown.

    "tf32" on a GPU without TF32 tensor cores falls back to the FP32 rate, because that is
    what such a GPU runs when TF32 is requested.
    """
    if gpu is None:
        return None
    kind = _DTYPE_ALIASES.get(dtype if isinstance(dtype, torch.dtype) else str(dtype).lower())
    if kind is None:
        raise ValueError(f"unknown dtype {dtype!r} for peak FLOP/s; use one of {', '.join(DTYPES)}")
    value = gpu.flops.get(kind)
    if value is None and kind == "tf32":
        value = gpu.flops.get("fp32")
    return value


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
