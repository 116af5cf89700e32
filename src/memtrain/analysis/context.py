"""The longest sequence length whose training step fits: ``memtrain maxbatch --search seq-len``.

The same search as the largest batch (:mod:`memtrain.analysis.maxbatch`), over the length at a
fixed micro-batch: a guess first, then confirmed by probes of the real step (traced under fake
tensors, or measured), which decide the answer: the found length fits and the next one
(length + ``multiple_of``) does not.

* The guess: the analytic estimate's own search (:func:`memtrain.analysis.fit.longest_context`,
  milliseconds per length) where the estimator models the run (memtrain's GPT; Llama, Qwen2,
  Mistral layers). Elsewhere (QLoRA, other families) a traced search fits the peak as a quadratic
  in the length through three traced probes (attention scores grow with its square, everything
  else at most linearly) and solves it for the budget.
* The confirmation: two probes (the guess fits, the next length does not); where they disagree
  the search steps outward from the guess and bisects (:func:`memtrain.analysis.fit.largest_fitting_from`).
  Then it climbs past a spike: the ``DIP_WINDOW`` lengths above the answer are probed and the
  search goes on from the longest that fits (:func:`memtrain.analysis.fit.largest_fitting_past_dips`,
  the estimate's and plan's search too): a measured peak need not be monotone in the length.
* A traced probe of a transformers model traces two shallow copies of it and extends every
  category to the real depth (:mod:`memtrain.analysis.depth_trace`): an 8B probe costs seconds
  at any length, not the minutes of 32 traced layers.
* Without a CUDA device, ``--gpu`` answers with the CUDA model (analytic, caching allocator and
  CUDA context): :func:`estimated_longest_context`.

What bounds the length (the position table) is :func:`memtrain.analysis.fit.context_bound`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from memtrain.analysis.advice import save_memory_clause, size_text
from memtrain.analysis.depth_trace import trace_any_depth
from memtrain.analysis.estimate.hf import modelled_arch
from memtrain.analysis.fit import (
    at_seq_len,
    largest_fitting_past_dips,
    length_search_bound,
    longest_context,
    past_the_bound,
    require_search_budget,
    step_need,
)
from memtrain.analysis.maxbatch import analytic_arch, measured_step_peak, resolve_method
from memtrain.config.run import ConfigError, RunConfig
from memtrain.runtime.env import resolve_device
from memtrain.runtime.notices import shows_progress

__all__ = ["LongestContextResult", "estimated_longest_context", "find_longest_context", "traced_length_peak"]

LengthProbe = Callable[[RunConfig], Optional[int]]  # a config at its length and batch -> peak, None: out of memory


@dataclass
class LongestContextResult:
    """``memtrain maxbatch --search seq-len --json``."""

    seq_len: int  # the longest length that fits (a multiple of multiple_of)
    peak_bytes: Optional[int]  # its step's peak
    next_seq_len: Optional[int]  # seq_len + multiple_of, which does not fit; None: the bound stopped the search
    next_peak_bytes: Optional[int]  # its peak (None where it ran out of device memory)
    batch_size: int
    budget_bytes: Optional[int]
    device: str
    method: str
    multiple_of: int
    max_len: int  # the longest length searched
    capped: bool  # seq_len == max_len: the bound, not the memory, stopped the search
    note: str  # what bounds the search (the position table)
    capped_note: Optional[str]
    past_fits: Optional[bool] = None  # capped: whether the length past the bound fits (None: not probed)
    guess: Optional[int] = None  # where the probes started (None: from the shortest length)
    guess_method: Optional[str] = None  # "analytic" | "fitted" (a quadratic through traced probes)
    probes: list[dict[str, Any]] = field(default_factory=list)
    measured: bool = True  # False: the CUDA model's answer, nothing ran
    device_memory: Optional[dict[str, Any]] = None
    search: str = "seq-len"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def traced_length_peak(cfg: RunConfig) -> int:
    """Peak bytes of ``cfg``'s step (at its length and batch) traced under fake tensors; a
    transformers model from two shallow copies extended to its depth where that is exact."""
    return int(trace_any_depth(cfg, resolve_device(cfg.train.device).type)["peak_bytes"])


def measured_length_peak(cfg: RunConfig) -> Optional[int]:
    """Peak bytes of two real steps of ``cfg`` (None: out of device memory)."""
    return measured_step_peak(cfg, cfg.train.batch_size)


def _analytic_guess(cfg: RunConfig, budget_bytes: int, batch: int, step: int, max_len: Optional[int],
                    device_type: str) -> Optional[int]:
    """The analytic estimate's longest length (in units of ``step``; 0 when not even the shortest
    fits by it), or None where the estimator does not model the run."""
    try:
        arch = modelled_arch(cfg, device_type)
        if arch is None:
            return None
        found = longest_context(lambda c: step_need(c, arch, device_type, None)[0], cfg, budget_bytes, batch, step,
                                max_len)["seq_len"]
    except Exception:  # noqa: BLE001 - no guess: the probes decide
        return None
    return 0 if found is None else found // step


def _fitted_guess(peak_at: Callable[[int], Optional[int]], budget_bytes: int, cap: int) -> Optional[int]:
    """The length (in units) where a quadratic through three traced peaks, at ``cap/16``, ``cap/8``
    and ``cap/4`` units, meets the budget; None for a search too short to need one, or peaks
    that do not fit a rising curve."""
    base = cap // 16
    if base < 1:
        return None
    ks = (base, 2 * base, 4 * base)
    peaks = [peak_at(k) for k in ks]
    if any(p is None for p in peaks):
        return None
    p1, p2, p4 = (float(p) for p in peaks if p is not None)
    # p(k) = a + b k + c k^2 through (base, p1), (2 base, p2), (4 base, p4)
    c = ((p4 - p2) / (2 * base) - (p2 - p1) / base) / (3 * base)
    b = (p2 - p1) / base - 3 * base * c
    a = p1 - b * base - c * base * base
    if c > 0:
        disc = b * b - 4 * c * (a - budget_bytes)
        if disc < 0:
            return None
        k = (-b + math.sqrt(disc)) / (2 * c)
    elif b > 0:
        k = (budget_bytes - a) / b
    else:
        return None
    return max(1, min(cap, int(k)))


def find_longest_context(  # noqa: C901 - guess, confirm, search outward: one search
    cfg: RunConfig,
    budget_bytes: Optional[int] = None,
    batch: int = 1,
    max_len: Optional[int] = None,
    multiple_of: Optional[int] = None,
    progress: Optional[bool] = None,
    method: str = "auto",
    probe: Optional[LengthProbe] = None,
) -> LongestContextResult:
    """The longest length (a multiple of ``multiple_of``, at most ``max_len``: see
    :func:`memtrain.analysis.fit.context_bound`) whose step at micro-batch ``batch`` fits
    ``budget_bytes`` (or, on CUDA without a budget, the device). See the module docstring."""

    device = resolve_device(cfg.train.device)
    require_search_budget(device.type, budget_bytes, "the longest context")
    step, bound = length_search_bound(cfg, max_len, multiple_of)
    cap = bound.max_len // step
    method = resolve_method(method, device.type)
    if probe is None:
        probe = traced_length_peak if method == "trace" else measured_length_peak
    peaks: dict[int, Optional[int]] = {}  # units -> peak (None: out of memory); each length probed once
    probes: list[dict[str, Any]] = []
    bar = tqdm(desc="longest context", unit="probe", leave=False, dynamic_ncols=True) if shows_progress(progress) else None

    def peak_at(k: int) -> Optional[int]:
        if k not in peaks:
            peak = peaks[k] = probe(at_seq_len(cfg, k * step, bound, batch))
            ok = peak is not None and (budget_bytes is None or peak <= budget_bytes)
            probes.append({"seq_len": k * step, "peak_bytes": peak, "fits": ok})
            if bar is not None:
                bar.set_postfix(seq_len=k * step, fits=ok, refresh=False)
                bar.update(1)
        return peaks[k]

    def fits(k: int) -> bool:
        peak = peak_at(k)
        return peak is not None and (budget_bytes is None or peak <= budget_bytes)

    guess, how = None, None
    try:
        if budget_bytes is not None:
            guess = _analytic_guess(cfg, budget_bytes, batch, step, max_len, device.type)
            how = "analytic" if guess else None
            if guess is None and method == "trace":
                guess = _fitted_guess(peak_at, budget_bytes, cap)
                how = "fitted" if guess is not None else None
        # 0: by the estimate nothing fits; the shortest length's probe decides. A measured peak
        # (CUDA's allocator) need not be monotone in the length: the search climbs past a spike as
        # the estimate's own (fit.longest_context) and plan's do.
        found = largest_fitting_past_dips(fits, cap, guess or None)
        if found is None:
            raise _nothing_fits(cfg, device.type, step, batch, peaks.get(1), budget_bytes)
        nxt = found + 1 if found < cap else None
        next_peak = peak_at(nxt) if nxt is not None else None
        past = None if nxt is not None else past_the_bound(
            cfg, bound, step, batch, probe, lambda p: p is not None and (budget_bytes is None or p <= budget_bytes))
        if past is not None:
            probes.append({"seq_len": past[0], "peak_bytes": past[1], "fits": past[2]})
    finally:
        if bar is not None:
            bar.close()
    length = found * step
    return LongestContextResult(
        seq_len=length, peak_bytes=peaks[found], next_seq_len=None if nxt is None else nxt * step,
        next_peak_bytes=next_peak, batch_size=batch, budget_bytes=budget_bytes, device=device.type, method=method,
        multiple_of=step, max_len=bound.max_len, capped=nxt is None, note=bound.note,
        capped_note=bound.capped_note(length, past) if nxt is None else None,
        past_fits=None if past is None else past[2], guess=None if guess is None else guess * step,
        guess_method=how, probes=probes)


def estimated_longest_context(cfg: RunConfig, budget_bytes: int, gpu: Optional[str], batch: int = 1,
                              max_len: Optional[int] = None,
                              multiple_of: Optional[int] = None) -> LongestContextResult:
    """The longest length by the CUDA model, where no CUDA device is here to measure it: the
    analytic estimate with CUDA kernel facts, replayed through the caching-allocator model, plus
    ``gpu``'s CUDA context ("default" when None). Nothing runs; ``measured`` is False."""
    arch = analytic_arch(cfg)
    step, bound = length_search_bound(cfg, max_len, multiple_of)
    probes: list[dict[str, Any]] = []

    def need(c: RunConfig) -> float:
        total = step_need(c, arch, "cuda", gpu)[0]
        probes.append({"seq_len": c.train.seq_len, "peak_bytes": int(total), "fits": total <= budget_bytes})
        return total

    ctx = longest_context(need, cfg, budget_bytes, batch, step, max_len)
    if ctx["seq_len"] is None:
        raise _nothing_fits(cfg, "cuda", step, batch, ctx["shortest_peak_bytes"], budget_bytes,
                            " on the device, estimated: the CUDA model, not measured")
    est = step_need(at_seq_len(cfg, ctx["seq_len"], bound, batch), arch, "cuda", gpu)[1]
    return LongestContextResult(
        seq_len=ctx["seq_len"], peak_bytes=ctx["peak_bytes"], next_seq_len=ctx["next_seq_len"],
        next_peak_bytes=ctx["next_peak_bytes"], batch_size=batch, budget_bytes=budget_bytes, device="cuda",
        method="estimate", multiple_of=step, max_len=bound.max_len, capped=ctx["capped"], note=bound.note,
        capped_note=ctx["capped_note"], past_fits=ctx["past_fits"], guess=None, guess_method=None, probes=probes, measured=False,
        device_memory=est.device_memory)


def _nothing_fits(cfg: RunConfig, device_type: str, step: int, batch: int, peak: Optional[float],
                  budget_bytes: Optional[int], how: str = "") -> ConfigError:
    need = f"needs {size_text(peak)}{how}" if peak is not None else "ran out of device memory"
    budget = f"the budget of {size_text(budget_bytes)}" if budget_bytes else "the device"
    save = save_memory_clause(cfg, budget_bytes, device_type, shorter_sequence=False)
    # Over the budget on the model's state alone, a smaller batch or length step does not help.
    shrink = [] if save.model_state else ["lower --batch-size or --multiple-of"]
    change = ", ".join([save.text] * bool(save.text) + shrink)
    return ConfigError(f"even {step:,} tokens at batch {batch} do not fit {budget} ({need}); {change}, or raise "
                       "--memory-budget")
