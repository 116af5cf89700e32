"""`memtrain info`: what this device does natively and how fast (memtrain.devices.probe.probe)."""

from __future__ import annotations

import argparse
from typing import Any

from memtrain.cli import register
from memtrain.files.json_text import dumps


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="Device to probe: auto|cpu|cuda|cuda:N (default auto: "
                   "CUDA when visible, else CPU).")
    p.add_argument("--json", action="store_true", help="Print the answers as JSON.")
    p.add_argument("--remeasure", action="store_true",
                   help="Measure the GEMM rates again instead of reading them from the per-machine cache "
                        "(e.g. after measuring on a busy machine).")


def _yn(value: Any) -> str:
    return "n/a" if value is None else ("yes" if value else "no")


def _rate(value: Any) -> str:
    return "n/a" if not value else f"{value / 1e9:,.3g} GFLOP/s"


def render(caps: dict[str, Any]) -> str:
    shapes = caps.get("gemm_shapes") or {}
    fp32_shape = "x".join(map(str, shapes.get("fp32", []))) or "?"
    low_shape = "x".join(map(str, shapes.get("low_precision", []))) or "?"

    def slow(key: str) -> str:
        v = caps.get(f"{key}_slowdown")
        if not v:
            return ""
        return f" ({v:.1f}x slower than FP32 on {low_shape})" if v > 1 else f" ({1 / v:.1f}x the FP32 rate on {low_shape})"

    cc = caps.get("compute_capability")
    lines = [
        f"device:            {caps['device_type']}: {caps['name']}" + (f" (compute capability {cc[0]}.{cc[1]})" if cc else ""),
        f"torch:             {caps['torch']}, {caps['threads']} threads",
        f"native BF16:       {_yn(caps['native_bf16'])} - {caps['bf16_reason']}",
        f"native FP16:       {_yn(caps['native_fp16'])} - {caps['fp16_reason']}",
        f"TF32 matmul:       {_yn(caps['tf32'])}",
        f"AdamW fused:       {_yn(caps['fused_adamw'])}",
        f"AdamW foreach:     {_yn(caps['foreach_adamw'])}",
        f"SDPA flash:        {_yn(caps['sdpa_flash'])}",
        f"SDPA mem-efficient: {_yn(caps['sdpa_mem_efficient'])}",
        f"GEMM FP32:         {_rate(caps['gemm_fp32_flops'])} ({fp32_shape})",
        f"GEMM BF16:         {_rate(caps['gemm_bf16_flops'])}{slow('bf16')}",
        f"GEMM FP16:         {_rate(caps['gemm_fp16_flops'])}{slow('fp16')}",
    ]
    if caps.get("isa_flags"):
        lines.append(f"ISA flags:         {' '.join(caps['isa_flags'])}")
    if caps.get("forced"):
        lines.append(f"forced:            {caps['forced']}")
    if caps.get("from_cache"):
        rates = "from the per-machine cache (--remeasure to measure again)"
    elif caps.get("cached_at"):
        rates = "measured now (cached for next time)"
    else:
        rates = "measured now (not cached: the cache folder cannot be written; MEMTRAIN_CACHE chooses another)"
    lines.append(f"rates:             {rates}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from memtrain.devices.probe import cache_clear, probe  # torch-free --help/estimate/plan
    from memtrain.runtime.env import resolve_device  # torch-free --help/estimate/plan

    device = resolve_device(args.device)
    if args.remeasure:
        cache_clear(device)
    caps = probe(device).to_dict()
    print(dumps(caps, indent=2) if args.json else render(caps))  # strict JSON: never NaN
    return 0


register("info", "What this device does natively (BF16/FP16/TF32 matmul, fused AdamW, flash SDPA) and its "
         "measured GEMM rate; the facts bench and train choose by.", add_args, run)
