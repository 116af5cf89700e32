"""The largest batch whose full training step fits: grow geometrically, then bisect.

A probe runs the real training step (forward, backward, optimizer step, twice, so optimizer
state exists) at one batch size and returns its peak:

* on CUDA without a budget: the step itself decides; a real out-of-memory error is caught,
  memory freed, and the search goes on;
* with ``budget_bytes`` (any device): the peak is compared with the budget; on CUDA the peak
  is ``max_memory_allocated``, elsewhere the tracked meter's peak, which makes the search
  testable on CPU;
* ``method="trace"`` runs the step under fake tensors (no memory, no compute) with the same
  tracked meter: the fast way to search on CPU.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from memtrain.analysis.advice import save_memory_clause, size_text
from memtrain.analysis.estimate import estimate
from memtrain.analysis.estimate.hf import modelled_arch, why_not_modelled
from memtrain.analysis.fit import (
    check_batch_bounds,
    largest_batch,
    largest_fitting,
    largest_fitting_from,
    require_search_budget,
    step_need,
)
from memtrain.analysis.trace import trace_peak_bytes
from memtrain.config.run import ConfigError, RunConfig
from memtrain.metrics import MemoryMeter, device_peak_memory
from memtrain.runtime.env import resolve_device
from memtrain.runtime.notices import shows_progress
from memtrain.techniques import make_precision
from memtrain.training.step import build_state, measure_steps, random_micro_batches

Probe = Callable[[RunConfig, int], Optional[int]]  # -> peak bytes, or None when it did not fit


@dataclass
class MaxBatchResult:
    batch_size: int
    peak_bytes: Optional[int]
    budget_bytes: Optional[int]
    device: str
    method: str
    probes: list[dict[str, Any]] = field(default_factory=list)
    # False where no step ran: the CUDA model's answer (estimated_max_batch); then peak_bytes is
    # the modelled device total and device_memory the caching-allocator model's figures.
    measured: bool = True
    device_memory: Optional[dict[str, Any]] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_step_memory(cfg: RunConfig, batch: int) -> Optional[dict[str, Any]]:
    """Memory of two real training steps at ``batch``: the second (steady-state: optimizer
    state exists) step's tracked stats (``MemoryStats.to_dict()``) plus the device peaks.
    None on a CUDA out-of-memory error. On CUDA the meter is off (it would slow the step and
    the allocator's own peak is the number that decides whether a batch fits). Built and
    stepped by the step harness (:mod:`memtrain.training.step`), as a training run is."""

    device = resolve_device(cfg.train.device)
    state = meter = None
    try:
        precision = make_precision(cfg.technique.precision, device)
        torch.manual_seed(cfg.train.seed)
        state = build_state(cfg, device, precision)
        # Memory does not depend on token values, so random ids stand in for data.
        micro = random_micro_batches(cfg, batch, device, torch.Generator().manual_seed(0))
        meter = MemoryMeter(state.model, state.optimizer) if device.type != "cuda" else None
        measure_steps(state, lambda: micro, steps=2, meter=meter)
        stats: dict[str, Any] = meter.stats().to_dict() if meter is not None else {"peak_bytes": None}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats.update(device_peak_memory(device))
        return stats
    except torch.OutOfMemoryError:
        return None
    finally:
        del state, meter
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measured_step_peak(cfg: RunConfig, batch: int) -> Optional[int]:
    """Peak bytes of a real steady-state training step (None when it ran out of memory):
    the tracked peak, or on CUDA ``max_memory_allocated``."""
    stats = measure_step_memory(cfg, batch)
    if stats is None:
        return None
    peak = stats["peak_bytes"] if stats["peak_bytes"] is not None else stats["max_allocated_bytes"]
    return int(peak)


def traced_step_peak(cfg: RunConfig, batch: int) -> Optional[int]:
    """Peak bytes of a training step traced under fake tensors (nothing allocated)."""

    return int(trace_peak_bytes(cfg.replace(batch_size=batch)))


def _analytic_guess(cfg: RunConfig, budget_bytes: Optional[int], multiple_of: int, cap: int,
                    device_type: str) -> Optional[int]:
    """The largest k <= ``cap`` whose analytic estimate of batch ``k * multiple_of`` fits the
    budget (the same grow-then-bisect, on arithmetic that costs milliseconds), or None where the
    estimator does not model the run. Only a starting point: the caller confirms it with probes."""
    if budget_bytes is None:
        return None
    # memtrain's GPT, or a transformers family and technique set the analytic model claims (the
    # same arithmetic with the transformers inventory); others (an unmodelled family or option)
    # are traced probe by probe.
    try:
        arch = modelled_arch(cfg, device_type)
        if arch is None:
            return None
        return largest_batch(lambda c: estimate(c, arch, device_type).peak_bytes, cfg, budget_bytes, multiple_of, cap)
    except Exception:  # noqa: BLE001 - no guess: the full search below decides
        return None


def _nothing_fits(cfg: RunConfig, device_type: str, batch: int, peak: Optional[float], budget_bytes: Optional[int],
                  how: str = "") -> ConfigError:
    need = f"needs {size_text(peak)}{how}" if peak is not None else "ran out of device memory"
    budget = f"the budget of {size_text(budget_bytes)}" if budget_bytes else "the device"
    return ConfigError(f"even batch {batch} does not fit {budget} ({need}); "
                       f"{save_memory_clause(cfg, budget_bytes, device_type).text}, or raise --memory-budget")


def estimated_max_batch(cfg: RunConfig, budget_bytes: int, gpu: Optional[str], max_batch: Optional[int] = None,
                        multiple_of: int = 1) -> MaxBatchResult:
    """The largest batch by the CUDA model, where no CUDA device is here to measure it: the
    analytic estimate with CUDA kernel facts, replayed through the caching-allocator model,
    plus ``gpu``'s CUDA context ("default" when None), against ``budget_bytes``
    (:func:`memtrain.analysis.fit.step_need`). Nothing runs; ``measured`` is False."""

    if multiple_of < 1:
        raise ConfigError(f"--multiple-of must be >= 1, got {multiple_of}")
    arch = analytic_arch(cfg)
    probes: list[dict[str, Any]] = []

    def need(c: RunConfig) -> float:
        total = step_need(c, arch, "cuda", gpu)[0]
        probes.append({"batch_size": c.train.batch_size, "peak_bytes": int(total), "fits": total <= budget_bytes})
        return total

    k = largest_batch(need, cfg, budget_bytes, multiple_of, (max_batch or 4096) // multiple_of)
    if k is None:
        raise _nothing_fits(cfg, "cuda", multiple_of, probes[0]["peak_bytes"], budget_bytes,
                            " on the device, estimated: the CUDA model, not measured")
    total, est = step_need(cfg.replace(batch_size=k * multiple_of), arch, "cuda", gpu)
    return MaxBatchResult(k * multiple_of, int(total), budget_bytes, "cuda", "estimate", probes, measured=False,
                          device_memory=est.device_memory)


def analytic_arch(cfg: RunConfig) -> Any:
    """The analytic model's Arch of ``cfg``: memtrain's GPT, or a transformers family the analytic
    model covers; any other transformers model is refused (it can only be traced or measured)."""
    arch = modelled_arch(cfg, "cuda")
    if arch is None:
        raise ConfigError(f"the CUDA model (no CUDA device here): {why_not_modelled(cfg, 'cuda')}; run maxbatch on a CUDA "
                          "machine, or drop --device-type cuda to search with CPU kernels")
    return arch


def resolve_method(method: str, device_type: str) -> str:
    """``auto``: measure on CUDA (real steps decide), trace elsewhere (fake tensors: nothing
    allocated), or measure where the tracer cannot be imported."""
    if method != "auto":
        return method
    if device_type == "cuda":
        return "measure"
    try:
        import memtrain.analysis.trace  # noqa: F401  # optional: the tracer's torch internals may be missing
    except ImportError:
        return "measure"
    return "trace"


def find_max_batch(  # noqa: C901 - grow then bisect, each with OOM and budget exits
    cfg: RunConfig,
    budget_bytes: Optional[int] = None,
    max_batch: Optional[int] = None,
    multiple_of: int = 1,
    progress: Optional[bool] = None,
    method: str = "auto",
    probe: Optional[Probe] = None,
) -> MaxBatchResult:
    """Search the largest batch (a multiple of ``multiple_of``, at most ``max_batch``) that fits."""

    device = resolve_device(cfg.train.device)
    require_search_budget(device.type, budget_bytes, "the max batch")
    limit = check_batch_bounds(max_batch, multiple_of)
    method = resolve_method(method, device.type)
    if probe is None:
        probe = traced_step_peak if method == "trace" else measured_step_peak
    probes: list[dict[str, Any]] = []
    bar = None
    if shows_progress(progress):
        bar = tqdm(desc="maxbatch", unit="probe", leave=False, dynamic_ncols=True)

    def fits(batch: int) -> tuple[bool, Optional[int]]:
        peak = probe(cfg, batch)
        ok = peak is not None and (budget_bytes is None or peak <= budget_bytes)
        probes.append({"batch_size": batch, "peak_bytes": peak, "fits": ok})
        if bar is not None:
            bar.set_postfix(batch=batch, fits=ok, refresh=False)
            bar.update(1)
        return ok, peak

    try:
        cap = limit // multiple_of  # the largest allowed batch, in units of multiple_of
        # A traced search costs one fake-tensor step per probe (about ten probes, most of a
        # bench row's overhead on CPU). The analytic estimate matches the trace on memtrain's
        # model, so start from its answer and confirm it with two probes: it fits and the next
        # batch does not (the first of them also shows that batch 1 fits: peaks grow with the
        # batch). Where they disagree the search steps outward from the guess (a chunked loss's
        # estimate can be a batch off; a traced probe of it costs seconds at hundreds of
        # sequences), so the answer is the traced one either way.
        found: Optional[int] = None
        if probe is traced_step_peak:
            guess = _analytic_guess(cfg, budget_bytes, multiple_of, cap, device.type)
            if guess is not None and guess > 1:
                ok, peak = fits(guess * multiple_of)
                if ok and (guess >= cap or not fits((guess + 1) * multiple_of)[0]):
                    return MaxBatchResult(guess * multiple_of, peak, budget_bytes, device.type, method, probes)
                start, start_fits = (guess + 1, True) if ok else (guess, False)
                found = largest_fitting_from(lambda k: fits(k * multiple_of)[0], cap, start, start_fits)
                if found is None:
                    peak_at_one = next(p["peak_bytes"] for p in probes if p["batch_size"] == multiple_of)
                    raise _nothing_fits(cfg, device.type, multiple_of, peak_at_one, budget_bytes)
        if found is None:
            ok, peak = fits(multiple_of)
            if not ok:
                raise _nothing_fits(cfg, device.type, multiple_of, peak, budget_bytes)
            found = largest_fitting(lambda k: fits(k * multiple_of)[0], cap)
        best = found * multiple_of
        best_peak = next(p["peak_bytes"] for p in reversed(probes) if p["batch_size"] == best and p["fits"])
    finally:
        if bar is not None:
            bar.close()
    return MaxBatchResult(best, best_peak, budget_bytes, device.type, method, probes)
