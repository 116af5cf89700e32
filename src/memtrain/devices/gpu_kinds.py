"""The GPU kinds memtrain knows: one table, torch-free, that every GPU fact derives from.

Each kind (keyed "h100-sxm", "rtx-4090", ...) carries its display name, its dense peak FLOP/s
per matmul type, its memory bandwidth, its memory and the facts the CUDA caching-allocator
model assumes for it. The names a user or ``torch.cuda.get_device_name`` gives ("NVIDIA H100
80GB HBM3", "rtx4090", "4090") resolve to a kind through :func:`gpu_table_key`'s patterns.
Read by :mod:`memtrain.devices.gpus` (peak FLOP/s, MFU), :mod:`memtrain.devices.gpu_memory`
(--gpu's memory) and :mod:`memtrain.analysis.allocator` (CUDA context, cuBLAS workspace).

FLOP/s are *dense* (NVIDIA datasheets headline 2:4 structured-sparsity numbers, twice the dense
ones; a training step gets none of that) tensor-core peaks at boost clock. Half precision is the
rate with FP32 accumulation, which is what PyTorch's matmuls use; on GeForce cards it is half
the FP16-accumulate rate the marketing quotes. ``fp32`` is the plain (non-tensor-core) FP32
rate; ``tf32`` the TF32 tensor-core rate; ``fp8`` the FP8 (E4M3/E5M2) tensor-core rate with FP32
accumulation, what ``torch._scaled_mm`` runs. ``None`` means the hardware has no tensor-core path
for that type (BF16 and TF32 before Ampere, FP8 before compute capability 8.9).

Sources (dense figures, sparse ones halved where only those are printed):
- Hopper: "NVIDIA H100 Tensor Core GPU Architecture" whitepaper (H100 SXM5 / PCIe tables) and
  the H100 and H200 datasheets (NVL variants, H200 memory bandwidth). FP8: "Peak FP8 Tensor
  TFLOPS with FP32 Accumulate" 1978.9 (SXM5) and 1513 (PCIe) dense in the whitepaper; the
  datasheets print 3,958 (H100 SXM, H200 SXM), 3,026 (H100 PCIe) and 3,341 (H100 NVL, H200 NVL)
  TFLOPS with sparsity, halved here.
- Ada FP8 (sparse figures halved): L4 datasheet 485, L40S datasheet 1,466; RTX 4090: Ada
  whitepaper "Peak FP8 Tensor TFLOPS with FP32 Accumulate" 330.3 dense.
- A100: "NVIDIA A100 Tensor Core GPU" datasheet (40GB/80GB, SXM/PCIe bandwidths).
- L4, L40S, A10, T4, V100: their NVIDIA datasheets.
- RTX 4090: "NVIDIA Ada GPU Architecture" whitepaper, appendix table for GeForce RTX 4090.
- RTX 3090: "NVIDIA Ampere GA102 GPU Architecture" whitepaper, GeForce RTX 3090 table.
- Blackwell (B200, GB200): NVIDIA's "Blackwell architecture technical brief" per-GPU table, as
  tabulated in Glenn Lockwood's B200 notes (glennklockwood.com/garden/processors/B200): the HGX
  B200 at 1,000 W and the GB200's B200 at 1,200 W, dense (its sparse column is twice these). FP8
  is the dense FP8 Tensor rate; HBM3e at 8 TB/s. B200 memory: the DGX/HGX B200 datasheet's
  1,440 GB over 8 GPUs (180 GB each; nvidia-smi on an HGX B200 prints 179 GB, Vultr's "HGX B200
  hardware overview"). GB200: no single figure (the GB200 systems expose different capacities
  per GPU), so it needs --budget, as the V100.
- L40: NVIDIA L40 datasheet (the L40/L40S table: TF32 90.5 | 181*, BF16/FP16 181.05 | 362.1*,
  FP8 362 | 724*, * with sparsity; FP32 90.5; 48 GB GDDR6 at 864 GB/s).
- RTX A6000: NVIDIA RTX A6000 datasheet as compared in Microway's "In-Depth Comparison of NVIDIA
  Ampere GPU Accelerators" (FP16/BF16 tensor 154.8 dense, 309.7 sparse; FP32 38.7; 48 GB GDDR6 at
  768 GB/s). Its TF32 rate is half its BF16 one (77.4), the GA102 ratio that the A40 datasheet
  prints (TF32 74.8 against BF16 149.7): derived, not printed in the sources found.
- Not in the table, for want of a sourced dense tensor rate (they resolve to no kind; name the
  closest one): RTX 5090 and RTX PRO 6000 Blackwell (sparse or FP4 "AI TOPS" figures only; the
  GeForce FP32-accumulate rate is not printed), RTX 6000 Ada (FP32 and bandwidth only), H20 (no
  NVIDIA datasheet; no FP8 rate found). AMD cards (MI300X) are not modelled: the allocator facts
  (cuBLAS workspace, CUDA context) and the FP8 rules here are NVIDIA's.
- A10G: AWS-only part without an NVIDIA datasheet; figures as compared against the A10 in
  Baseten's "NVIDIA A10 vs A10G for ML model inference" (same 600 GB/s memory, half the
  A10's tensor rate, a higher FP32 rate).

Memory: "h100-sxm" and "h200" are MEASURED: torch.cuda.get_device_properties(0).total_memory of an
"NVIDIA H100 80GB HBM3" (85,017,493,504 B = 79.18 GiB, less than the 80 GiB on its datasheet) and of
an "NVIDIA H200" (150,109,880,320 B = 139.80 GiB, less than its 141 GB read as GiB); the records they
come from: docs/estimation.md, ``budget_bytes``. The others are the DATASHEET capacity read as GiB, an
assumption: the driver keeps part of it, as the H100 shows. None: the datasheet lists two sizes
under one name (V100 16/32 GB); such a card needs --budget.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from memtrain.techniques.facts import MATMUL_TYPES

__all__ = ["AllocatorFacts", "DEFAULT_ALLOCATOR", "GPU_KINDS", "GpuKind", "LARGE_BUFFER", "MIN_BLOCK", "MIN_LARGE_ALLOC",
           "PCIE4_X16_PINNED_COPY", "ROUND_LARGE", "SMALL_BUFFER", "SMALL_SIZE", "allocator_facts", "gpu_kind", "gpu_table_key", "has_fp8",
           "named_gpu_key", "peak_of", "unknown_gpu_line"]

T = 1e12  # TFLOP/s
GBs = 1e9  # GB/s (decimal, as datasheets state bandwidth)
MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class AllocatorFacts:
    """What a process holds on the device outside the tensors the caching allocator hands out.

    ``label`` names the facts in the allocator model's output ("h100"); ``cuda_context_bytes``:
    the driver's context plus the kernels of torch's CUDA libraries, as nvidia-smi shows it after
    a training step; ``cublas_workspace_bytes``: cuBLAS's workspace per handle and stream,
    allocated through the caching allocator at the first matmul; ``context_measured``: whether
    the context figure was measured (else an assumption); ``context_source``: the results folder
    (in this repository) that records the measurement, its command, commit and card, for a
    measured one; ``loose_names``: substrings of a
    squashed device name (lowercase, no spaces or dashes) that select these facts where the
    name matches no pattern of :func:`gpu_table_key` ("h100sxm", "rtx 4090 d").
    """

    label: str
    cuda_context_bytes: int
    cublas_workspace_bytes: int
    context_measured: bool = False
    loose_names: tuple[str, ...] = ()
    context_source: str = ""


# The host link a GPU's pinned host copies run over (bytes/s, each way): PCIe 4.0 x16 carries
# 32 GB/s each way on paper and pinned copies reach about 25 GB/s of it (CUDA's bandwidthTest
# figure for such a link; PCIe 5.0 x16 doubles it, NVLink-C2C on a Grace Hopper reaches ~450 GB/s
# each way).
PCIE4_X16_PINNED_COPY = 25 * GBs

# The caching allocator's block and segment sizes: torch's c10/cuda/CUDACachingAllocator.cpp
# (kMinBlockSize, kSmallSize, kSmallBuffer, kLargeBuffer, kMinLargeAlloc, kRoundLarge), the same
# on every GPU kind; memtrain.analysis.allocator replays them.
MIN_BLOCK = 512  # every request rounded up to a multiple of this
SMALL_SIZE = 1 * MiB  # requests up to this come from the small pool
SMALL_BUFFER = 2 * MiB  # the small pool's segment
LARGE_BUFFER = 20 * MiB  # a large-pool segment for a request under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB  # a larger request's segment: the request rounded up to this

# torch's default CUBLAS_WORKSPACE_CONFIG: 4096 KiB x 8 on Hopper, 4096 KiB x 2 + 16 KiB x 8 before it.
_HOPPER_WORKSPACE = 4096 * 1024 * 8
_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8
# The CUDA context, as nvidia-smi shows it: the driver's context plus the kernels of torch's CUDA
# libraries, loaded lazily (CUDA 12) by the first kernels that use them, so it is read after a
# training step. H100: MEASURED after a training step by benchmarks/allocator_check.py (its run,
# commit and card: docs/estimation.md, the ``device_total`` row). The others are ASSUMPTIONS
# (typical published figures, not measured here); they differ by driver and CUDA version.
_H100_ALLOC = AllocatorFacts("h100", 787_283_968, _HOPPER_WORKSPACE, context_measured=True, loose_names=("h100",),
                             context_source="benchmarks/results/gpu-h100/allocator-check")
# H200: the H100's die (sm90), so torch picks the Hopper workspace; its context is ASSUMED to be the
# H100's measured one (the same sm90 kernels of torch's libraries), not measured on an H200.
_H200_ALLOC = AllocatorFacts("h200", _H100_ALLOC.cuda_context_bytes, _HOPPER_WORKSPACE, loose_names=("h200",))
_A100_ALLOC = AllocatorFacts("a100", 440 * MiB, _WORKSPACE, loose_names=("a100",))
_RTX4090_ALLOC = AllocatorFacts("rtx4090", 380 * MiB, _WORKSPACE, loose_names=("rtx4090", "4090"))
# Any other GPU: an assumption.
DEFAULT_ALLOCATOR = AllocatorFacts("default", 500 * MiB, _WORKSPACE)
# Blackwell (B200, GB200: sm100): torch gives compute capability 9, 10, 11 and 12 the 32 MiB
# workspace (CublasHandlePool.cpp, "32MiB for Hopper and Blackwell"; 9.0 only in older releases).
# Their context is the default assumption: not measured on a Blackwell card.
_BLACKWELL_ALLOC = AllocatorFacts("blackwell", DEFAULT_ALLOCATOR.cuda_context_bytes, _HOPPER_WORKSPACE,
                                  loose_names=("b200",))
# In the order a loose name is tried.
_LOOSE_ALLOCATORS = (_H100_ALLOC, _H200_ALLOC, _A100_ALLOC, _RTX4090_ALLOC, _BLACKWELL_ALLOC)


@dataclass(frozen=True)
class GpuKind:
    """One GPU model: its dense peak FLOP/s by matmul type, memory bandwidth (bytes/s), memory
    (bytes; None where one name covers two sizes) and its caching-allocator facts (None: the
    default assumption, :data:`DEFAULT_ALLOCATOR`)."""

    name: str
    flops: Mapping[str, Optional[float]] = field(repr=False, hash=False)  # a dict: not hashable
    mem_bandwidth: float
    memory_bytes: Optional[int]
    memory_measured: bool = False
    allocator: Optional[AllocatorFacts] = None


def _kind(name: str, bf16: Optional[float], fp16: Optional[float], tf32: Optional[float], fp32: float,
          bandwidth: float, memory: Optional[int], allocator: Optional[AllocatorFacts] = None,
          memory_measured: bool = False, fp8: Optional[float] = None) -> GpuKind:
    rates = {"bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32, "fp8": fp8}
    assert tuple(rates) == MATMUL_TYPES  # a rate for each matmul type the precisions name
    return GpuKind(name, rates, bandwidth, memory, memory_measured, allocator)


# In the order error messages list the kinds.
GPU_KINDS: dict[str, GpuKind] = {
    # Hopper. SXM5: 132 SMs at 1.83 GHz; PCIe: 114 SMs at 1.755 GHz (whitepaper).
    "h100-sxm": _kind("H100 SXM", 989.4 * T, 989.4 * T, 494.7 * T, 66.9 * T, 3350 * GBs, 85_017_493_504,
                      _H100_ALLOC, memory_measured=True, fp8=1978.9 * T),
    "h100-pcie": _kind("H100 PCIe", 756.0 * T, 756.0 * T, 378.0 * T, 51.2 * T, 2000 * GBs, 80 * GiB, _H100_ALLOC,
                       fp8=1513.0 * T),
    "h100-nvl": _kind("H100 NVL", 835.5 * T, 835.5 * T, 417.5 * T, 60.0 * T, 3900 * GBs, 94 * GiB, _H100_ALLOC,
                      fp8=1670.5 * T),
    # H200 is the H100 SXM die with 141 GB of HBM3e; its memory is measured (the module's docstring).
    "h200": _kind("H200 SXM", 989.4 * T, 989.4 * T, 494.7 * T, 66.9 * T, 4800 * GBs, 150_109_880_320,
                  _H200_ALLOC, memory_measured=True, fp8=1978.9 * T),
    "h200-nvl": _kind("H200 NVL", 835.5 * T, 835.5 * T, 417.5 * T, 60.0 * T, 4800 * GBs, 141 * GiB, _H200_ALLOC,
                      fp8=1670.5 * T),
    # Blackwell data centre (rates and memory: the module's docstring). CUDA context: the default
    # assumption, not measured on these cards.
    "b200": _kind("B200", 2250 * T, 2250 * T, 1100 * T, 80 * T, 8000 * GBs, 180 * GiB, _BLACKWELL_ALLOC,
                  fp8=4500 * T),
    "gb200": _kind("GB200", 2500 * T, 2500 * T, 1250 * T, 90 * T, 8000 * GBs, None, _BLACKWELL_ALLOC,
                   fp8=5000 * T),
    # Ampere data centre.
    "a100-40gb-sxm": _kind("A100 40GB SXM", 312 * T, 312 * T, 156 * T, 19.5 * T, 1555 * GBs, 40 * GiB, _A100_ALLOC),
    "a100-80gb-sxm": _kind("A100 80GB SXM", 312 * T, 312 * T, 156 * T, 19.5 * T, 2039 * GBs, 80 * GiB, _A100_ALLOC),
    "a100-40gb-pcie": _kind("A100 40GB PCIe", 312 * T, 312 * T, 156 * T, 19.5 * T, 1555 * GBs, 40 * GiB,
                            _A100_ALLOC),
    "a100-80gb-pcie": _kind("A100 80GB PCIe", 312 * T, 312 * T, 156 * T, 19.5 * T, 1935 * GBs, 80 * GiB,
                            _A100_ALLOC),
    "a10": _kind("A10", 125 * T, 125 * T, 62.5 * T, 31.2 * T, 600 * GBs, 24 * GiB),
    "a10g": _kind("A10G", 70 * T, 70 * T, 35 * T, 35 * T, 600 * GBs, 24 * GiB),
    # Ada data centre.
    "l4": _kind("L4", 121 * T, 121 * T, 60 * T, 30.3 * T, 300 * GBs, 24 * GiB, fp8=242.5 * T),
    "l40s": _kind("L40S", 362.05 * T, 362.05 * T, 183 * T, 91.6 * T, 864 * GBs, 48 * GiB, fp8=733 * T),
    "l40": _kind("L40", 181.05 * T, 181.05 * T, 90.5 * T, 90.5 * T, 864 * GBs, 48 * GiB, fp8=362 * T),
    # Ampere workstation (full-rate FP32 accumulate, unlike GeForce).
    "rtx-a6000": _kind("RTX A6000", 154.8 * T, 154.8 * T, 77.4 * T, 38.7 * T, 768 * GBs, 48 * GiB),
    # GeForce (FP32-accumulate tensor rates).
    "rtx-4090": _kind("RTX 4090", 165.2 * T, 165.2 * T, 82.6 * T, 82.6 * T, 1008 * GBs, 24 * GiB, _RTX4090_ALLOC,
                      fp8=330.3 * T),
    "rtx-3090": _kind("RTX 3090", 71 * T, 71 * T, 35.6 * T, 35.6 * T, 936 * GBs, 24 * GiB),
    # Volta and Turing: FP16 tensor cores only.
    "v100-sxm2": _kind("V100 SXM2", None, 125 * T, None, 15.7 * T, 900 * GBs, None),
    "v100-pcie": _kind("V100 PCIe", None, 112 * T, None, 14 * T, 900 * GBs, None),
    "v100s-pcie": _kind("V100S PCIe", None, 130 * T, None, 16.4 * T, 1134 * GBs, 32 * GiB),
    "t4": _kind("T4", None, 65 * T, None, 8.1 * T, 320 * GBs, 16 * GiB),
}

# The names each kind answers to. First match wins, so variants come before the bare model name.
# Patterns run on the lowercased name with punctuation turned into spaces, e.g. "nvidia a100 sxm4 80gb".
_PATTERNS: list[tuple[str, str]] = [
    (r"\bgb200\b", "gb200"),
    (r"\bb200\b", "b200"),
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
    (r"\bl40\b", "l40"),
    (r"\bl4\b", "l4"),
    # "NVIDIA RTX A6000"; the RTX 6000 Ada Generation is another card.
    (r"\ba6000\b", "rtx-a6000"),
    # "rtx4090" (estimate --gpu's spelling) as well as "RTX 4090"; the China-market 4090 D is a
    # different part, as is the 3090 Ti.
    (r"(?:\b|(?<=rtx))4090\b(?!\s*d\b)", "rtx-4090"),
    (r"(?:\b|(?<=rtx))3090\b(?!\s*ti\b)", "rtx-3090"),
    (r"\bv100s\b", "v100s-pcie"),
    (r"\bv100\b.*\bpcie\b", "v100-pcie"),
    (r"\bv100\b", "v100-sxm2"),
    (r"\bt4\b", "t4"),
]


def peak_of(flops: Mapping[str, Optional[float]], matmul_type: str) -> Optional[float]:
    """Dense peak FLOP/s for ``matmul_type`` from a kind's rates, None where it has none.

    "tf32" on a GPU without TF32 tensor cores falls back to the FP32 rate, because that is
    what such a GPU runs when TF32 is requested."""
    value = flops.get(matmul_type)
    if value is None and matmul_type == "tf32":
        value = flops.get("fp32")
    return value


def gpu_table_key(name: Optional[str]) -> Optional[str]:
    """The table key of a device name as ``torch.cuda.get_device_name`` gives it ("NVIDIA H100
    80GB HBM3", "Tesla T4") or a short name ("h100", "4090", "a100-80gb-pcie"); None when the
    name is not a known GPU (including "cpu")."""
    if not name:
        return None
    key = name.strip().lower()
    if key in GPU_KINDS:
        return key
    norm = re.sub(r"[^a-z0-9]+", " ", key).strip()
    for pattern, table_key in _PATTERNS:
        if re.search(pattern, norm):
            return table_key
    return None


# The words a --gpu NAME may hold besides the parts of the table's keys: those of the names
# torch.cuda.get_device_name and nvidia-smi print ("NVIDIA A100-SXM4-80GB", "Tesla V100S-PCIE-32GB",
# "NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3") and the squashed "rtx4090".
_DEVICE_NAME_WORDS = frozenset({"nvidia", "tesla", "geforce", "rtx", "rtx4090", "rtx3090", "sxm", "sxm2", "sxm3",
                                "sxm4", "sxm5", "pcie", "nvl", "hbm2", "hbm2e", "hbm3", "hbm3e"})
_MEMORY_WORD = re.compile(r"\d+gb")


def named_gpu_key(name: str) -> Optional[str]:
    """The table key a user's ``--gpu NAME`` names, or None: a key itself, or a name made only
    of the words GPU names are made of (a key's parts, the vendor's words, a memory size such as
    80gb), separated by spaces, dashes or underscores, that :func:`gpu_table_key` resolves.
    ``gpu_table_key`` searches a device name for its model, which suits what CUDA reports but
    took "A100;rm" or "my t4 card" for a known card; every verb's --gpu goes through this rule."""
    key = name.strip().lower()
    if key in GPU_KINDS:
        return key
    if not re.fullmatch(r"[a-z0-9][a-z0-9 _-]*", key):
        return None
    allowed = _DEVICE_NAME_WORDS | {part for k in GPU_KINDS for part in k.split("-")}
    if not all(word in allowed or _MEMORY_WORD.fullmatch(word) for word in re.split(r"[ _-]+", key) if word):
        return None
    return gpu_table_key(key)


def unknown_gpu_line(name: str) -> str:
    """What the one line refusing a --gpu NAME no kind answers to says after the flag: the known names."""
    return f"{name!r} is no GPU kind memtrain knows; choose one of {', '.join(GPU_KINDS)} (or the name nvidia-smi prints)"


def has_fp8(name: Optional[str]) -> bool:
    """Whether the GPU a name resolves to has FP8 tensor cores (an ``fp8`` rate in its row);
    False for an unknown name and for "cpu"."""
    kind = gpu_kind(name)
    return kind is not None and kind.flops.get("fp8") is not None


def gpu_kind(name: Optional[str]) -> Optional[GpuKind]:
    """The kind a device name resolves to (see :func:`gpu_table_key`), or None."""
    key = gpu_table_key(name)
    return GPU_KINDS[key] if key is not None else None


def allocator_facts(name: Optional[str]) -> AllocatorFacts:
    """The caching-allocator facts to assume for a device name: its kind's, else those whose
    loose name the squashed name contains (a spelling the patterns miss), else the default."""
    kind = gpu_kind(name)
    if kind is not None and kind.allocator is not None:
        return kind.allocator
    squashed = (name or "").lower().replace(" ", "").replace("-", "")
    return next((facts for facts in _LOOSE_ALLOCATORS if any(n in squashed for n in facts.loose_names)),
                DEFAULT_ALLOCATOR)
