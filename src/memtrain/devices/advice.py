"""What a run records and says about its device: the slow-precision warning and MFU's reference.

Kept apart from :mod:`memtrain.devices.probe` (which only probes) and from the train loop (which only
calls :func:`run_device_facts` and :func:`mfu_for_run`).

MFU on CUDA is against the GPU's datasheet peak (:mod:`memtrain.devices.gpus`); a CPU has no
datasheet figure torch can look up, so CPU MFU is against the GEMM rate measured on this machine
(named ``measured_gemm`` in the result). That reference is the rate a plain square matmul reaches
here, not a theoretical peak, so a CPU MFU reads "how much of what this machine's BLAS does". A
run measures it again right after its training steps (:func:`reference_rate_now`: the best of
repeated products over 0.3 s), so the row and its reference see the same load on a shared machine;
a rate cached by the probe minutes earlier, under other load, made the same row read 67.7% in one
bench and 31.6% in another.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Optional

import torch

from memtrain.devices.gpus import device_gpu, mfu, peak_flops
from memtrain.devices.probe import (
    FP32_SHAPE,
    CacheDir,
    DeviceCaps,
    measure_fp32_rate,
    precision_is_native,
    probe,
    refresh_fp32_rate,
    slow_precision_message,
)
from memtrain.runtime.notices import SlowPrecisionWarning
from memtrain.techniques.facts import half_matmul_type

__all__ = ["SlowPrecisionWarning", "run_device_facts", "mfu_for_run", "reference_rate_now", "warn_if_slow"]


def warn_if_slow(precision: str, caps: DeviceCaps) -> Optional[str]:
    """Warn (once per process and message) when ``precision`` is not native here; return the text."""
    msg = slow_precision_message(precision, caps)
    if msg:
        warnings.warn(msg, SlowPrecisionWarning, stacklevel=3)
    return msg


def _reference_rate(caps: DeviceCaps, precision: str) -> tuple[Optional[float], str]:
    """The measured GEMM rate a CPU row is judged against, and its dtype name."""
    fp32 = caps.gemm_fp32_flops
    if not fp32:
        return None, "fp32"
    key = half_matmul_type(precision)
    slowdown = getattr(caps, f"{key}_slowdown") if key else None
    # Low-precision rates are measured on a small transformer-like shape; scaled to the square
    # FP32 shape by their ratio on the same shape. A row in BF16 is judged against whichever
    # kernel is faster here (autocast on a CPU without native BF16 runs BF16 anyway, slowly,
    # and its MFU should show that).
    if key and slowdown and slowdown < 1:
        return fp32 / slowdown, key
    return fp32, "fp32"


def reference_rate_now(caps: Optional[DeviceCaps]) -> Optional[float]:
    """On a CPU, the FP32 GEMM rate measured now (best of repeated products over 0.3 s), the
    reference of this run's MFU; None on CUDA, without a probe, or when it cannot be measured."""
    if caps is None or caps.device_type != "cpu":
        return None
    try:
        return measure_fp32_rate()
    except Exception:  # noqa: BLE001 - the run keeps the probe's cached rate
        return None


REFERENCE_NOW = "measured right after the run's training steps (best of repeated products over 0.3 s)"


def mfu_for_run(flops_per_step: float, step_time_s: Optional[float], device: torch.device, precision: str,
                caps: Optional[DeviceCaps], rate_now: Optional[float] = None, cache_dir: CacheDir = None
                ) -> tuple[Optional[float], Optional[dict[str, Any]]]:
    """MFU and its reference: CUDA against the datasheet peak, CPU against the measured GEMM rate
    (``rate_now``, from :func:`reference_rate_now`, where given; else the probe's cached rate,
    refreshed in the cache under ``cache_dir`` when the run beat it)."""
    if not step_time_s:
        return None, None
    if device.type == "cuda":
        gpu = device_gpu(device)
        peak = peak_flops(gpu, precision)
        ref = {"kind": "datasheet_peak", "name": gpu.name if gpu else None, "flops_per_s": peak,
               "dtype": precision}
        return mfu(flops_per_step, step_time_s, gpu, precision), ref
    if caps is None:
        return None, None
    if rate_now:
        rate, dtype = _reference_rate(replace(caps, gemm_fp32_flops=rate_now), precision)
        assert rate is not None  # a positive FP32 rate gives a reference
        return flops_per_step / step_time_s / rate, _cpu_reference(caps, rate, dtype, list(FP32_SHAPE), REFERENCE_NOW)
    rate, dtype = _reference_rate(caps, precision)
    if not rate:
        return None, None
    if flops_per_step / step_time_s > rate:
        # The run beat the reference: it was measured while the cores were busier than now.
        refresh_fp32_rate(caps, cache_dir)
        rate, dtype = _reference_rate(caps, precision)
        if not rate:
            return None, None
    when = "by the device probe (cached per machine; measured again when a run beat it)"
    return flops_per_step / step_time_s / rate, _cpu_reference(caps, rate, dtype, caps.gemm_shapes.get("fp32", []), when)


def _cpu_reference(caps: DeviceCaps, rate: float, dtype: str, shape: list[int], when: str) -> dict[str, Any]:
    """The result's ``mfu_reference`` of a CPU run: what the rate is, and when it was measured."""
    return {"kind": "measured_gemm", "name": f"{caps.name}, measured {dtype.upper()} GEMM {'x'.join(map(str, shape))}",
            "flops_per_s": rate, "dtype": dtype, "measured": when}


def run_device_facts(precision: str, device: torch.device,
                     cache_dir: CacheDir = None) -> tuple[Optional[DeviceCaps], dict[str, Any]]:
    """Probe the device (its rates cached under ``cache_dir``: the run's cache folder), warn when
    ``precision`` is slow here, and return what the result records under ``device_caps``. A probe
    that fails costs the run nothing but these facts."""
    try:
        caps = probe(device, cache_dir=cache_dir)
    except Exception as exc:  # noqa: BLE001 - the run must not fail for a missing fact
        return None, {"error": f"{type(exc).__name__}: {exc}"}
    msg = warn_if_slow(precision, caps)
    facts = {
        "name": caps.name,
        "native_bf16": caps.native_bf16,
        "native_fp16": caps.native_fp16,
        "bf16_reason": caps.bf16_reason,
        "bf16_slowdown": caps.bf16_slowdown,
        "fp16_slowdown": caps.fp16_slowdown,
        "gemm_fp32_flops": caps.gemm_fp32_flops,
        "gemm_bf16_flops": caps.gemm_bf16_flops,
        "forced": caps.forced,
        "precision_native": precision_is_native(precision, caps),
        "precision_warning": msg,
    }
    return caps, facts

