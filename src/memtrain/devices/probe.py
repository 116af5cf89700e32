"""What this device does natively, and how fast: probed once, before anything chooses for it.

CPUs differ more than their names suggest. On a CPU without BF16 instructions (AVX2-only x86,
e.g. many AMD EPYC and older Xeon cloud machines) oneDNN has no fast BF16 kernel and a BF16
matmul falls back to a slow reference path, several times (LM-head shape) to hundreds of times
(square matmuls) slower than FP32 (the measured figures and their machine: docs/performance.md,
"Devices"). Training in BF16 there silently turns a minutes-long job into an hour.
:func:`probe` answers, per device:

- native BF16 / FP16 matmul: CPU from the ISA flags torch's cpuinfo reads (``avx512_bf16``,
  ``amx_bf16``, ``avx512_fp16``, ``amx_fp16``; ``bf16``/``fphp`` on Arm) and oneDNN's own checks
  (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX512-core or better); CUDA from the
  compute capability (BF16 and TF32 tensor cores from sm_80, FP16 from sm_70);
- TF32 matmul (CUDA sm_80+; the ``amx_tf32`` flag on CPU);
- fused / foreach AdamW kernels (probed by one tiny step on the device);
- flash / memory-efficient SDPA (probed by one tiny call under ``sdpa_kernel``);
- a measured GEMM rate, FP32 and (where usable) BF16 and FP16, on small fixed shapes.

The measured rates take up to about a second, so they are cached per machine in the memtrain
cache directory as JSON (the run's: ``MEMTRAIN_CACHE``, else ``--cache-dir``, as for the token
cache; a caller without a run config passes none and gets ``MEMTRAIN_CACHE``, else
``~/.cache/memtrain``), keyed by the device
model, the torch version and the thread count; a cache file that cannot be read is ignored and
rewritten. ``MEMTRAIN_FORCE_NATIVE_BF16=0|1`` overrides the native-BF16 answer and
``MEMTRAIN_FORCE_NATIVE_FP16=0|1`` the native-FP16 one (tests use them to run every code path on
any CPU; a user may use them when the probe is wrong). The measured rates are never forced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memtrain.config.run import CACHE_ENV, DEFAULT_CACHE_DIR
from memtrain.devices.forced import FORCE_BF16_ENV, FORCE_FP16_ENV, forced as _forced
from memtrain.devices.tf32 import fp32_only
from memtrain.errors import ConfigError
from memtrain.files.guard import regular_file_problem
from memtrain.files.results import write_text_atomic
from memtrain.techniques.facts import half_matmul_type

__all__ = ["DeviceCaps", "probe", "cache_clear", "cpu_model", "cpu_flags", "measure_gemm", "measure_fp32_rate", "FORCE_BF16_ENV",
           "FORCE_FP16_ENV", "cache_path", "slow_precision_message", "precision_is_native"]

CACHE_VERSION = 1

# GEMM shapes (M, K, N) timed for the rates. Small on purpose: the probe must stay under about a
# second even where BF16 runs at 0.3 GFLOP/s. The FP32 shape is square so the rate is close to
# what the BLAS reaches on this machine (the reference of CPU MFU); the low-precision slowdown
# is measured on a small transformer-like shape (tokens x d_model x 2*d_model of the default
# model) against FP32 on the same shape, and the low-precision rate reported is the FP32 rate
# divided by that slowdown.
FP32_SHAPE = (1024, 1024, 1024)
CPU_LOW_SHAPE = (64, 256, 512)
CUDA_SHAPE = (4096, 4096, 4096)
TIME_BUDGET_S = 0.15  # per rate: repeat the GEMM until this much time is spent, keep the best


@dataclass
class DeviceCaps:
    """The answers of :func:`probe` for one device. Rates are FLOP/s (None: not measured)."""

    device_type: str  # "cpu" or "cuda"
    name: str  # CPU model or GPU name
    torch: str
    threads: int
    native_bf16: bool
    native_fp16: bool
    tf32: bool
    bf16_reason: str  # why native_bf16 is what it is, in words
    fp16_reason: str
    fused_adamw: Optional[bool]  # None: not probed (kernels=False)
    foreach_adamw: Optional[bool]
    sdpa_flash: Optional[bool]
    sdpa_mem_efficient: Optional[bool]
    gemm_fp32_flops: Optional[float] = None
    gemm_bf16_flops: Optional[float] = None
    gemm_fp16_flops: Optional[float] = None
    # FP32 rate over the low-precision rate on the same shape (> 1: the low precision is slower).
    bf16_slowdown: Optional[float] = None
    fp16_slowdown: Optional[float] = None
    gemm_shapes: dict[str, list[int]] = field(default_factory=dict)
    isa_flags: list[str] = field(default_factory=list)
    compute_capability: Optional[list[int]] = None
    forced: Optional[str] = None  # the overrides in effect, e.g. "MEMTRAIN_FORCE_NATIVE_BF16=0"
    from_cache: bool = False
    # Where measured rates were stored for the next run (None: read from the cache, not measured,
    # or the cache could not be written, e.g. a read-only folder).
    cached_at: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def label(self) -> str:
        """One line for report headers: the model and whether BF16 is native."""
        bf16 = "native BF16" if self.native_bf16 else "no native BF16"
        if self.forced:
            bf16 += f" ({self.forced})"
        return f"{self.name}; {bf16}"


# ----------------------------------------------------------------------------- CPU facts
@lru_cache(maxsize=1)
def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC 7B13", "Intel(R) Xeon(R) Platinum 8481C")."""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        m = re.search(rf"^{key}\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
        if m:
            return m.group(1).strip()
    return platform.processor() or platform.machine() or "unknown cpu"


# Flags that matter for low-precision matmuls (x86 names; Arm's in the second set).
_X86_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16",
              "amx_tile", "amx_bf16", "amx_fp16", "amx_tf32")
_ARM_FLAGS = ("asimd", "asimdhp", "fphp", "bf16", "sve", "sve2", "i8mm")


def cpu_flags() -> list[str]:
    """The low-precision-relevant ISA flags /proc/cpuinfo lists (x86 ``flags``, Arm ``Features``),
    topped up with torch's own cpuinfo checks where /proc is absent."""
    m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", _cpuinfo(), re.MULTILINE)
    present = set(m.group(1).split()) if m else set()
    out = [f for f in _X86_FLAGS + _ARM_FLAGS if f in present]
    checks = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported",
              "amx_fp16": "_is_amx_fp16_supported"}
    for flag, fn in checks.items():
        check = getattr(torch.cpu, fn, None)
        if flag not in out and check is not None:
            try:
                if check():
                    out.append(flag)
            except Exception:  # noqa: BLE001 - a missing probe is "unknown", not a failure
                pass
    return out


def _mkldnn_check(name: str) -> bool:
    try:
        return bool(getattr(torch.ops.mkldnn, name)())
    except Exception:  # noqa: BLE001 - older builds lack the op
        return False


def _cpu_native(flags: list[str]) -> tuple[bool, str, bool, str]:
    arm = platform.machine().lower() in ("aarch64", "arm64")
    onednn_bf16 = _mkldnn_check("_is_mkldnn_bf16_supported")
    onednn_fp16 = _mkldnn_check("_is_mkldnn_fp16_supported")
    bf16_flags = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] + (["bf16"] if arm and "bf16" in flags else [])
    fp16_flags = [f for f in ("avx512_fp16", "amx_fp16") if f in flags] + (
        [f for f in ("fphp", "asimdhp") if arm and f in flags])
    # oneDNN's check is true from AVX512-core on (it converts BF16 in AVX512 registers, which is
    # fast enough); without it and without a BF16 instruction, torch runs a reference kernel.
    native_bf16 = bool(bf16_flags) or onednn_bf16
    if bf16_flags:
        bf16_reason = f"CPU has {'/'.join(bf16_flags)}"
    elif onednn_bf16:
        bf16_reason = "oneDNN has a BF16 kernel for this CPU (AVX512-core)"
    else:
        bf16_reason = "no avx512_bf16/amx_bf16 flag, and oneDNN has no BF16 kernel for it"
    native_fp16 = bool(fp16_flags) or onednn_fp16
    if fp16_flags:
        fp16_reason = f"CPU has {'/'.join(fp16_flags)}"
    elif onednn_fp16:
        fp16_reason = "oneDNN has an FP16 kernel for this CPU"
    else:
        fp16_reason = "no avx512_fp16/amx_fp16 flag, and oneDNN has no FP16 kernel for it"
    return native_bf16, bf16_reason, native_fp16, fp16_reason


# ----------------------------------------------------------------------------- kernel probes
def _probe_adamw(device: torch.device, **kind: Any) -> bool:
    """Whether ``torch.optim.AdamW(**kind)`` runs one step on ``device``."""
    try:
        p = torch.nn.Parameter(torch.ones(4, device=device))
        p.grad = torch.ones(4, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.optim.AdamW([p], lr=1e-3, **kind).step()
        return True
    except Exception:  # noqa: BLE001 - "not available" is the answer
        return False


def _probe_sdpa(device: torch.device, backend_name: str) -> bool:
    """Whether scaled_dot_product_attention runs with only ``backend_name`` allowed."""
    try:
        backend = getattr(SDPBackend, backend_name)
        # Flash needs half precision on CUDA; FP32 is what the CPU flash kernel takes.
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        q = torch.randn(1, 2, 16, 32, device=device, dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return True
    except Exception:  # noqa: BLE001
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_gemm(device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int],
                 budget_s: float = TIME_BUDGET_S) -> Optional[float]:
    """Best FLOP/s of an (M x K) @ (K x N) matmul in ``dtype`` over repeats filling ``budget_s``,
    after untimed warm-up products (which pick a kernel, allocate and wake a GPU). None if the
    dtype does not run here."""
    m, k, n = shape
    try:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        # Untimed warm-up first: a cold GPU's first products pay for cuBLAS's handle, kernel
        # selection and clocks ramping up from idle (one cold product can read tens of times
        # below the warm rate). On CUDA a product is cheap, so a few timed repeats are
        # always taken; on a CPU without native BF16 one slow product must stay one.
        cuda = device.type == "cuda"
        for _ in range(3 if cuda else 1):
            torch.matmul(a, b)
        _sync(device)
        times: list[float] = []
        spent = 0.0
        while spent < budget_s or (cuda and len(times) < 5):
            _sync(device)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            _sync(device)
            dt = time.perf_counter() - t0
            times.append(dt)
            spent += dt
        best = min(times)
        return 2.0 * m * k * n / best if best > 0 else None
    except Exception:  # noqa: BLE001 - a dtype without a kernel on this device
        return None


def _rates(device: torch.device, low: list[torch.dtype]) -> dict[str, Any]:
    """FP32 rate, low-precision rates and their slowdowns against FP32 on the same shape."""
    if device.type == "cuda":
        fp32_shape = low_shape = CUDA_SHAPE
    else:
        fp32_shape, low_shape = FP32_SHAPE, CPU_LOW_SHAPE
    threads = torch.get_num_threads()
    # TF32 off for the FP32 rate: it is the plain FP32 reference (restored afterwards, through the
    # API that set it: memtrain.devices.tf32).
    with torch.no_grad(), fp32_only():
        try:
            fp32 = measure_gemm(device, torch.float32, fp32_shape)
            out: dict[str, Any] = {"gemm_fp32_flops": fp32,
                                   "gemm_shapes": {"fp32": list(fp32_shape), "low_precision": list(low_shape)}}
            # The low-precision rates and slowdowns use one CPU thread: a kernel ratio barely
            # depends on threads, and one thread keeps it honest on a shared machine, where
            # OpenMP threads waiting on each other distort small multi-threaded GEMMs.
            if device.type == "cpu":
                torch.set_num_threads(1)
            fp32_low = measure_gemm(device, torch.float32, low_shape)
            for dtype, key in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
                if dtype not in low:
                    continue
                rate = measure_gemm(device, dtype, low_shape)
                slowdown = (fp32_low / rate) if (rate and fp32_low) else None
                out[f"{key}_slowdown"] = slowdown
                # Reported at the FP32 shape and all threads: the FP32 rate over the slowdown.
                out[f"gemm_{key}_flops"] = (fp32 / slowdown) if (fp32 and slowdown) else rate
        finally:
            torch.set_num_threads(threads)
    return out


# ----------------------------------------------------------------------------- cache
CacheDir = Optional[str | os.PathLike[str]]


def cache_path(key: str, cache_dir: CacheDir = None) -> Path:
    """The cache file of ``key`` under ``cache_dir`` (a run passes its effective cache folder,
    :func:`memtrain.config.run.effective_cache_dir`); None: ``$MEMTRAIN_CACHE``, else the default."""
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()
    return root / "device" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


# What a cache entry's ``rates`` may hold: the measured rates and slowdowns (positive, finite
# numbers; those of a precision not measured may be absent or null), the shapes they were
# measured on, and the rate a refresh replaced. Nothing else of DeviceCaps comes from the file.
_RATE_KEYS = ("gemm_fp32_flops", "gemm_bf16_flops", "gemm_fp16_flops", "bf16_slowdown", "fp16_slowdown",
              "refreshed_from")
_SHAPE_KEYS = ("fp32", "low_precision")


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _valid_rates(rates: Any) -> bool:
    """Whether a cache entry's ``rates`` is exactly what :func:`_rates` writes, every value sound."""
    if not isinstance(rates, dict) or not _positive_number(rates.get("gemm_fp32_flops")):
        return False
    if set(rates) - {*_RATE_KEYS, "gemm_shapes"}:
        return False
    if any(rates.get(k) is not None and not _positive_number(rates[k]) for k in _RATE_KEYS):
        return False
    shapes = rates.get("gemm_shapes", {})
    return (isinstance(shapes, dict) and set(shapes) <= set(_SHAPE_KEYS)
            and all(isinstance(s, list) and len(s) == 3 and all(type(n) is int and n > 0 for n in s)
                    for s in shapes.values()))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} in a device cache entry")  # JSON has no NaN/Infinity; Python's reader takes them


MAX_CACHE_BYTES = 2**16  # an entry is under 1 KiB; a larger file is not one of ours


def _read_cache(path: Path, key: str) -> Optional[dict[str, Any]]:
    """The cached rates, or None when absent or damaged in any way (a file that is not strict
    JSON, a field of the wrong type, a rate that is NaN, infinite, zero or negative, a folder
    in the file's place). A damaged entry is measured again and rewritten: a wrong value read
    here would end up in every MFU, in ``info --json`` (as invalid JSON) and in every train.
    Checked before it is opened: a FIFO in its place blocked ``info`` and every train for ever,
    a link to ``/dev/zero`` was read without end."""
    if regular_file_problem(path, path.parent, max_bytes=MAX_CACHE_BYTES) is not None:
        return None
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(data, dict) or data.get("key") != key or data.get("version") != CACHE_VERSION:
        return None
    rates = data.get("rates")
    return rates if _valid_rates(rates) else None


def _write_cache(path: Path, key: str, rates: dict[str, Any]) -> bool:
    """Write the entry atomically (a temporary file, then a rename); whether it was written. A
    cache that cannot be written is skipped (it only costs the next run another measurement)."""
    if not _valid_rates(rates):
        return False  # never store what the reader would refuse
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_empty_dir(path)  # a folder in the entry's place (one with files stays: the write is refused)
        write_text_atomic(path, json.dumps({"version": CACHE_VERSION, "key": key, "rates": rates}, indent=2,
                                           allow_nan=False) + "\n")
    except (OSError, ValueError, ConfigError):
        return False  # a read-only cache (or a link in its place) only costs the next run another second
    return True


def _remove_empty_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _discard(path: Path) -> None:
    """Remove a cache entry (or an empty folder in its place); what cannot be removed stays."""
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- probe
_PROBES: dict[tuple[str, bool], DeviceCaps] = {}


def _cache_key(device_type: str, name: str, threads: int) -> str:
    # The rate depends on the device model, the torch build (its BLAS) and the threads used.
    return f"{device_type}|{name}|torch {torch.__version__}|threads {threads}|shapes {FP32_SHAPE} {CPU_LOW_SHAPE} {CUDA_SHAPE}"


def cache_clear(device: torch.device | str = "cpu", cache_dir: CacheDir = None) -> None:
    """Forget the probe of ``device`` in this process and its cached rates on disk (under
    ``cache_dir``, as :func:`cache_path` resolves it)."""
    device = torch.device(device)
    _PROBES.clear()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    _discard(cache_path(_cache_key(device.type, name, torch.get_num_threads()), cache_dir))


def probe(device: torch.device | str = "cpu", measure: bool = True, kernels: bool = True,
          measure_fn: Optional[Callable[[torch.device, list[torch.dtype]], dict[str, Any]]] = None,
          cache_dir: CacheDir = None) -> DeviceCaps:
    """Capabilities of ``device`` (see the module docstring); with ``measure`` the GEMM rates too
    (from the per-machine cache under ``cache_dir`` when present, see :func:`cache_path`); with
    ``kernels`` the optimizer and SDPA kernel probes (tiny runs on the device). Memoized per
    process (the rates are the machine's, whichever folder caches them). The random number
    generators are left exactly as they were (a run seeds, then probes, then builds its weights)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
        return _probe(device, measure, kernels, measure_fn, cache_dir)


def _probe(device: torch.device, measure: bool, kernels: bool,
           measure_fn: Optional[Callable[[torch.device, list[torch.dtype]], dict[str, Any]]],
           cache_dir: CacheDir) -> DeviceCaps:
    memo_key = (str(device), measure, kernels, os.environ.get(FORCE_BF16_ENV, ""), os.environ.get(FORCE_FP16_ENV, ""))
    if measure_fn is None and memo_key in _PROBES:  # type: ignore[comparison-overlap]
        return _PROBES[memo_key]  # type: ignore[index]
    threads = torch.get_num_threads()
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        native_bf16 = cap >= (8, 0)
        bf16_reason = f"compute capability {cap[0]}.{cap[1]}" + (" has BF16 tensor cores" if native_bf16 else
                                                                  " has no BF16 tensor cores (needs 8.0+)")
        native_fp16 = cap >= (7, 0)
        fp16_reason = f"compute capability {cap[0]}.{cap[1]}" + (" has FP16 tensor cores" if native_fp16 else
                                                                  " has no FP16 tensor cores (needs 7.0+)")
        tf32 = cap >= (8, 0)
        flags: list[str] = []
        capability: Optional[list[int]] = list(cap)
        sdpa_flash = (torch.backends.cuda.is_flash_attention_available() and _probe_sdpa(device, "FLASH_ATTENTION")
                      if kernels else None)
    else:
        name = cpu_model()
        flags = cpu_flags()
        native_bf16, bf16_reason, native_fp16, fp16_reason = _cpu_native(flags)
        tf32 = "amx_tf32" in flags
        capability = None
        sdpa_flash = _probe_sdpa(device, "FLASH_ATTENTION") if kernels else None
    overrides = []
    forced = _forced(FORCE_BF16_ENV)
    if forced is not None:
        native_bf16 = forced
        overrides.append(f"{FORCE_BF16_ENV}={int(forced)}")
        bf16_reason = f"forced by {overrides[-1]} (probe said: {bf16_reason})"
    forced = _forced(FORCE_FP16_ENV)
    if forced is not None:
        native_fp16 = forced
        overrides.append(f"{FORCE_FP16_ENV}={int(forced)}")
        fp16_reason = f"forced by {overrides[-1]} (probe said: {fp16_reason})"
    forced_text = ", ".join(overrides) or None
    caps = DeviceCaps(
        device_type=device.type, name=name, torch=torch.__version__, threads=threads,
        native_bf16=native_bf16, native_fp16=native_fp16, tf32=tf32,
        bf16_reason=bf16_reason, fp16_reason=fp16_reason,
        fused_adamw=_probe_adamw(device, fused=True) if kernels else None,
        foreach_adamw=_probe_adamw(device, foreach=True) if kernels else None,
        sdpa_flash=sdpa_flash, sdpa_mem_efficient=_probe_sdpa(device, "EFFICIENT_ATTENTION") if kernels else None,
        isa_flags=flags, compute_capability=capability, forced=forced_text,
    )
    if measure:
        low = [torch.bfloat16, torch.float16]
        key = _cache_key(device.type, name, threads)
        path = cache_path(key, cache_dir)
        rates = None if measure_fn is not None else _read_cache(path, key)
        if rates is None:
            rates = (measure_fn or _rates)(device, low)
            if measure_fn is None:
                caps.cached_at = str(path) if _write_cache(path, key, rates) else None
        else:
            caps.from_cache = True
        for k, v in rates.items():
            if hasattr(caps, k):
                setattr(caps, k, v)
    if device.type == "cuda":
        # Give the probe's blocks back: they would otherwise stay reserved by the caching
        # allocator and count in the run's max_memory_reserved.
        torch.cuda.empty_cache()
    if measure_fn is None:
        _PROBES[memo_key] = caps  # type: ignore[index]
    return caps


def measure_fp32_rate(budget_s: float = 2 * TIME_BUDGET_S) -> Optional[float]:
    """The CPU's FP32 GEMM rate now: the best of repeated ``FP32_SHAPE`` products over ``budget_s``
    (best, not median: on a shared machine the least-disturbed product is the closest to what
    the BLAS does). The random number generators are left as they were."""
    with fp32_only(), torch.no_grad(), torch.random.fork_rng(devices=[]):
        return measure_gemm(torch.device("cpu"), torch.float32, FP32_SHAPE, budget_s=budget_s)


def refresh_fp32_rate(caps: DeviceCaps, cache_dir: CacheDir = None) -> DeviceCaps:
    """Measure the FP32 GEMM rate again and keep the best seen (here and in the cache under
    ``cache_dir``, see :func:`cache_path`).

    A rate measured while other processes shared the cores is too low and would make every
    later MFU too high; the train loop calls this when a run achieved more than the reference.
    The best rate seen on a machine is the closest to what its BLAS can do."""
    if caps.device_type != "cpu":
        return caps
    rate = measure_fp32_rate()
    if rate and rate > (caps.gemm_fp32_flops or 0):
        old = caps.gemm_fp32_flops
        caps.gemm_fp32_flops = rate
        for key in ("bf16", "fp16"):  # reported at the FP32 shape: FP32 rate over the slowdown
            slow = getattr(caps, f"{key}_slowdown")
            if slow:
                setattr(caps, f"gemm_{key}_flops", rate / slow)
        key = _cache_key("cpu", caps.name, caps.threads)
        path = cache_path(key, cache_dir)
        rates = _read_cache(path, key)
        if rates is not None and (rates.get("gemm_fp32_flops") or 0) <= rate:
            rates.update({k: getattr(caps, k) for k in ("gemm_fp32_flops", "gemm_bf16_flops", "gemm_fp16_flops")})
            rates["refreshed_from"] = old
            _write_cache(path, key, rates)
    return caps


# ----------------------------------------------------------------------------- precision advice
def precision_is_native(precision: str, caps: DeviceCaps) -> bool:
    """Whether ``precision`` (a config value) has fast matmul kernels on the probed device."""
    half = half_matmul_type(precision)
    if half == "bf16":
        return caps.native_bf16
    if half == "fp16":
        return caps.native_fp16
    return True


def slow_precision_message(precision: str, caps: DeviceCaps) -> Optional[str]:
    """The one-line warning for a precision without a native kernel here, with the measured
    slowdown; None when the precision is native."""
    if precision_is_native(precision, caps):
        return None
    key = half_matmul_type(precision) or "bf16"  # not native: a half-precision matmul
    slowdown = getattr(caps, f"{key}_slowdown")
    what = "BF16" if key == "bf16" else "FP16"
    reason = caps.bf16_reason if key == "bf16" else caps.fp16_reason
    where = "this CPU" if caps.device_type == "cpu" else "this GPU"
    if slowdown and slowdown > 1:
        speed = f"{key} matmul here is {slowdown:.1f}x slower than fp32"
    elif slowdown:
        speed = f"{key} matmul here measured {1 / slowdown:.1f}x the fp32 rate"
    else:
        speed = f"{key} matmul here has no fast kernel"
    return (f"--precision {precision}: {speed}; {where} has no native {what} ({reason}). "
            f"Expect slow steps; --precision fp32 is the fast path here.")
