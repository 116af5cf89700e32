"""Fit a bench's rows to the device before any of them runs.

On a device without native BF16 (an AVX2-only CPU, a pre-Ampere GPU) a BF16 row's matmuls run
a slow reference kernel, several to hundreds of times slower than FP32; the default
`memtrain bench` spent over an hour there instead of minutes (the measured figures behind this
docstring, with their machines: docs/performance.md, "Devices" and "Keeping the default bench
within minutes on 2 CPU cores"). So:

- rows of the *default* list run their BF16 precision in the faster of the native ones instead:
  FP16 where that is native and not measured slower than FP32 (a CPU with native FP16 can still
  run it slower than FP32), else FP32; the result records the substitution so
  the report can say so beside the row;
- rows the user listed explicitly run as asked, with a warning up front naming the measured
  slowdown;
- on a CPU, rows of the default list whose optimizer is one of torchao's low-bit AdamWs run
  Adafactor instead (:func:`adapt_compiled_optims`): torchao compiles their update with
  inductor, whose C++ build of it takes most of the row with a cold compile cache, a large
  share of the whole default bench; its eager path is no substitute (far slower per step, and
  its peak several times the compiled step's). Adafactor (torch's, no compile) keeps the row what
  it is for, the lowest memory: its factored state is smaller still. Without torchao installed
  (it is the ``lowbit`` extra) they run Adafactor on any device, saying how to install it.
- on CUDA, rows of the default list that pair ``--attention flash`` with a window run a kernel
  that takes one (:func:`adapt_window_kernels`): SDPA's flash kernel takes no mask, so the
  banded window cannot reach it there (the CPU's flash kernel takes the band mask).
- rows of the default list in ``--precision fp8`` are left out on a device without FP8 tensor
  cores (:func:`adapt_fp8_rows`); named in --techniques they run as asked and are refused there
  with the reason.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

import torch

from memtrain.bench.cuda_caps import cuda_caps_in_child
from memtrain.config.run import RunConfig, effective_cache_dir
from memtrain.devices.probe import DeviceCaps, precision_is_native, probe, slow_precision_message
from memtrain.techniques.facts import LOW_BIT_BLOCK, half_matmul_type, precision_facts

__all__ = ["adapt_compiled_optims", "adapt_fp8_rows", "adapt_rows", "adapt_window_kernels", "has_fp8_cores",
           "nearest_native", "runner_caps", "window_kernel"]


def runner_caps(device: torch.device, cfg: Optional[RunConfig] = None) -> Optional[DeviceCaps]:
    """The device's capabilities as the bench runner may learn them: on CPU the full probe (GEMM
    rates cached in the cache folder of ``cfg``, a row's config, where given); on CUDA the compute capability only, without running a kernel,
    asked of a child process (torch initialises CUDA to answer, and CUDA state in the runner would
    stay beside every row it measures: :mod:`memtrain.bench.cuda_caps`; each row probes itself)."""
    try:
        if device.type == "cpu":
            return probe(device, cache_dir=effective_cache_dir(cfg.data) if cfg is not None else None)
        if device.type == "cuda":
            return cuda_caps_in_child(device)
    except Exception:  # noqa: BLE001 - without the answer, rows run as listed (each row probes again)
        return None
    return None


def nearest_native(precision: str, caps: DeviceCaps) -> str:
    """The precision a slow ``precision`` row runs in instead: the faster measured of the native
    ones. FP16 (autocast) where it is native and its measured GEMM slowdown against FP32 is below
    1 (or unmeasured: a GPU's FP16 tensor cores, probed without running a kernel); else FP32."""
    if half_matmul_type(precision) == "bf16" and caps.native_fp16:
        if caps.fp16_slowdown is None or caps.fp16_slowdown < 1:
            return "fp16"
    return "fp32"


def _fp16_passed_over(caps: DeviceCaps) -> str:
    """Why a native FP16 was not chosen (its measured slowdown), or "" when it was not native."""
    if caps.native_fp16 and caps.fp16_slowdown is not None and caps.fp16_slowdown >= 1:
        return f"fp16 is native here but measured {caps.fp16_slowdown:.1f}x slower than fp32"
    return ""


def adapt_rows(rows: list[tuple[str, RunConfig]], caps: Optional[DeviceCaps], substitute: bool
               ) -> tuple[list[tuple[str, RunConfig]], dict[str, dict[str, Any]], list[str]]:
    """Rows to run, the substitutions made (by row name) and the warnings to print up front.

    ``substitute``: the rows are the default list (the user chose none), so slow precisions are
    replaced; otherwise they run as asked and each slow precision is warned about once.
    """
    if caps is None:
        return rows, {}, []
    out: list[tuple[str, RunConfig]] = []
    subs: dict[str, dict[str, Any]] = {}
    warned: dict[str, list[str]] = {}
    for name, cfg in rows:
        precision = cfg.technique.precision
        if precision_is_native(precision, caps):
            out.append((name, cfg))
            continue
        msg = slow_precision_message(precision, caps) or ""
        if substitute:
            alt = nearest_native(precision, caps)
            subs[name] = {"from": precision, "to": alt, "reason": msg}
            if alt == "fp32" and _fp16_passed_over(caps):
                subs[name]["fp16_passed_over"] = _fp16_passed_over(caps)
            cfg = cfg.replace(precision=alt)
        else:
            warned.setdefault(msg, []).append(name)
        out.append((name, cfg))
    warnings = [f"{msg} Rows: {', '.join(names)}." for msg, names in warned.items()]
    if subs:
        by: dict[tuple[str, str], list[str]] = {}
        for name, s in subs.items():
            by.setdefault((s["from"], s["to"]), []).append(name)
        for (src, alt), names in by.items():
            reason = subs[names[0]]["reason"].split(": ", 1)[-1].split(". Expect")[0]
            if subs[names[0]].get("fp16_passed_over"):
                reason += "; " + subs[names[0]]["fp16_passed_over"]
            warnings.append(f"{src} rows of the default list run in {alt} here ({reason}): "
                            f"{', '.join(names)}. Name them in --techniques to run them in {src} anyway.")
    return out, subs, warnings


# Optimizers whose update torchao compiles on first use, and what a CPU default-list row runs
# instead (see the module docstring).
COMPILED_OPTIMS = tuple(LOW_BIT_BLOCK)  # torchao's low-bit AdamWs (memtrain.techniques.facts)
CPU_OPTIM_SUBSTITUTE = "adafactor"


def _substituted(rows: list[tuple[str, RunConfig]],
                 substitute: Callable[[RunConfig], Optional[tuple[dict[str, Any], RunConfig]]],
                 ) -> tuple[list[tuple[str, RunConfig]], dict[str, dict[str, Any]]]:
    """Each row, replaced where ``substitute`` gives (what changed, the row's new config), in
    order; and what changed, by row name."""
    out: list[tuple[str, RunConfig]] = []
    subs: dict[str, dict[str, Any]] = {}
    for name, cfg in rows:
        change = substitute(cfg)
        if change is not None:
            subs[name], cfg = change
        out.append((name, cfg))
    return out, subs


def adapt_compiled_optims(rows: list[tuple[str, RunConfig]], device_type: str, substitute: bool
                          ) -> tuple[list[tuple[str, RunConfig]], dict[str, dict[str, Any]], list[str]]:
    """On a CPU, the default list's (``substitute``) low-bit AdamW rows run Adafactor instead.

    Returns the rows, the substitutions by row name (``{"from", "to", "reason"}``, recorded as
    the result's ``substituted_optim``) and the line to print up front. Rows the user named run
    as asked.
    """
    if not substitute:
        return rows, {}, []
    # torchao is an optional extra (memtrain[lowbit]): without it the default list's low-bit rows
    # run Adafactor on any device, where they would otherwise fail.
    installed = importlib.util.find_spec("torchao") is not None
    if installed and device_type != "cpu":
        return rows, {}, []
    if installed:
        where, reason = "On this CPU", ("torchao compiles its low-bit AdamW update on first use, ~95 s on 2 CPU "
                                        "cores with a cold compile cache")
        todo = "Name them in --techniques to run torchao's optimizer anyway."
    else:
        where, reason = "Without torchao", "torchao, the lowbit extra, is not installed"
        todo = "pip install 'memtrain[lowbit]' to run torchao's optimizer."

    def adafactor(cfg: RunConfig) -> Optional[tuple[dict[str, Any], RunConfig]]:
        optim = cfg.technique.optim
        if optim not in COMPILED_OPTIMS:
            return None
        return ({"from": optim, "to": CPU_OPTIM_SUBSTITUTE, "reason": reason, "where": where},
                cfg.replace(optim=CPU_OPTIM_SUBSTITUTE))

    out, subs = _substituted(rows, adafactor)
    notes = []
    if subs:
        notes.append(f"low-bit AdamW rows of the default list run {CPU_OPTIM_SUBSTITUTE} "
                     f"({where[0].lower() + where[1:]}: {reason}): {', '.join(subs)}. {todo}")
    return out, subs, notes


def window_kernel() -> str:
    """The CUDA kernel a windowed flash row runs instead: flash-attn's own sliding window
    (``window_size``, dropout included) where the package is installed, else SDPA's
    memory-efficient kernel, which takes the band mask and dropout."""
    return "flash-attn" if importlib.util.find_spec("flash_attn") is not None else "mem-efficient"


def adapt_window_kernels(rows: list[tuple[str, RunConfig]], device_type: str, substitute: bool
                         ) -> tuple[list[tuple[str, RunConfig]], dict[str, dict[str, Any]], list[str]]:
    """On CUDA, the default list's (``substitute``) rows of ``--attention flash`` with a window
    run :func:`window_kernel` instead.

    Returns the rows, the substitutions by row name (``{"from", "to", "reason"}``, recorded as
    the result's ``substituted_attention`` and named in the report) and the line to print up
    front. Rows the user named run as asked (and are refused with the reason).
    """
    if not substitute or device_type != "cuda":
        return rows, {}, []
    kernel = window_kernel()
    reason = "SDPA's flash kernel takes no mask on CUDA, so it cannot run a sliding window"

    def windowed(cfg: RunConfig) -> Optional[tuple[dict[str, Any], RunConfig]]:
        tech = cfg.technique
        if tech.attention != "flash" or tech.window is None:
            return None
        return {"from": "flash", "to": kernel, "reason": reason}, cfg.replace(attention=kernel)

    out, subs = _substituted(rows, windowed)
    notes = []
    if subs:
        notes.append(f"windowed flash rows of the default list run the {kernel} kernel on CUDA ({reason}): "
                     f"{', '.join(subs)}.")
    return out, subs, notes


def has_fp8_cores(caps: Optional[DeviceCaps]) -> bool:
    """Whether the probed device has FP8 tensor cores (CUDA, compute capability 8.9+)."""
    need = precision_facts("fp8").min_capability
    assert need is not None
    cap = caps.compute_capability if caps is not None else None
    return caps is not None and caps.device_type == "cuda" and cap is not None and tuple(cap) >= need


def adapt_fp8_rows(rows: list[tuple[str, RunConfig]], caps: Optional[DeviceCaps], substitute: bool
                   ) -> tuple[list[tuple[str, RunConfig]], list[str]]:
    """The default list's (``substitute``) ``--precision fp8`` rows left out where the device has
    no FP8 tensor cores (unknown, a CPU, a GPU before compute capability 8.9), with the line to
    print up front. Rows the user named run as asked."""
    if not substitute or has_fp8_cores(caps):
        return rows, []
    dropped = [name for name, cfg in rows if precision_facts(cfg.technique.precision).fp8]
    if not dropped:
        return rows, []
    where = caps.name if caps is not None else "this device"
    note = (f"fp8 rows of the default list are left out: {where} has no FP8 tensor cores (compute capability "
            f"8.9+, e.g. H100): {', '.join(dropped)}.")
    return [(name, cfg) for name, cfg in rows if name not in dropped], [note]
