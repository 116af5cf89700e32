"""The bench report's closing recommendation and its reading aids: pure functions of records.

* A max batch whose search never failed hit the search's cap: it is a lower bound ("256+").
* A memory category that is zero at the peak in every row is hidden, with the reason; a zero in
  some rows is explained by the phase the peak fell in.
* The recommendation: the fastest row that fits the budget (or, when several are equally fast
  within the measured step-time noise, the one of them with the smallest peak), the
  smallest-memory row within ``within`` of the fastest, and which rows' perplexity differs by
  more than the noise: the spread of a row and its noise twins where twins ran (the figure of the
  noise section), else the spread between rows that compute the same function.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from memtrain.devices.numerics import numerics_key
from memtrain.report.labels import method_cell
from memtrain.report.noise import (
    FACTOR,
    NUDGE_SUFFIX,
    faster_beyond_noise,
    fmt_noise,
    is_noise_twin,
    quality_vs_noise,
    step_noise,
)

GIB = 2**30


def max_batch_capped(row: dict[str, Any]) -> bool:
    """True when every probe of the row's max-batch search fitted: the cap stopped it."""
    probes = (row.get("max_batch") or {}).get("probes") or []
    return bool(probes) and all(p.get("fits") for p in probes)


def zero_categories(records: list[dict[str, Any]], categories: tuple[str, ...]) -> list[str]:
    """Categories that are 0 at the peak in every finished row."""
    ok = [r for r in records if r.get("status") == "ok"]
    # Only a recorded 0 is structural; a row without a breakdown (None) says nothing either way.
    return [c for c in categories if ok and all(r.get(f"{c}_bytes") == 0 for r in ok)]


WHY_ZERO = {
    "parameters": "every row's model has weights; zero means the meter saw none at the peak (a fully "
                  "offloaded or sharded-away model)",
    "gradients": "gradients exist from the backward pass until the optimizer step frees them "
                 "(zero_grad(set_to_none)); a peak in the forward pass or early in backward, before "
                 "the first gradient is written, holds none",
    "optimizer": "optimizer state is created by the first step; a row without state (SGD without "
                 "momentum) holds none",
    "activations": "activations are freed as backward consumes them; a peak late in backward holds none",
    "temporaries": "temporaries are the loss's logits and kernel work buffers; the chunked loss never "
                   "holds the full logits, so a peak elsewhere holds none",
}


def zero_notes(records: list[dict[str, Any]], categories: tuple[str, ...], hidden: list[str]) -> list[str]:
    """One line per category that is zero in some (not all) rows or hidden for being zero in all."""
    lines = []
    for c in hidden:
        lines.append(f"- {c.capitalize()} column hidden: zero at the peak in every row ({WHY_ZERO[c]}).")
    ok = [r for r in records if r.get("status") == "ok"]
    for c in categories:
        if c in hidden:
            continue
        zero_rows = [r for r in ok if r.get(f"{c}_bytes") == 0]
        if zero_rows:
            where = ", ".join(r["method"] + (f" (peak in {r['peak_phase']})" if r.get("peak_phase") else "")
                              for r in zero_rows)
            lines.append(f"- {c.capitalize()} 0.0 in {where}: {WHY_ZERO[c]}.")
    return lines


def same_function_loss_spread(rows: list[dict[str, Any]]) -> Optional[float]:
    """The largest val-loss spread among rows that compute the same function (same precision,
    optimizer, window and LoRA): rounding noise. None without two such rows."""
    groups: dict[Any, list[float]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("val_loss") is not None:
            groups.setdefault(numerics_key(r.get("config", {})), []).append(float(r["val_loss"]))
    spreads = [max(v) - min(v) for v in groups.values() if len(v) > 1]
    return max(spreads) if spreads else None


def recommendation(records: list[dict[str, Any]], rows: list[dict[str, Any]], budget: Optional[float],
                   within: float = 0.10) -> list[str]:
    """The report's closing section (Markdown lines). Noise twins (``X-nudgeN``, ``X-seed2``) are never
    recommended: they are there to measure noise. A row is called faster than another only beyond
    the measured step-time noise (report/noise.py); rows equally fast within noise are told apart
    by their tracked peak memory, the smaller winning."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("step_time_s") and not is_noise_twin(r.get("technique"))]
    if not ok:
        return []
    lines = ["## Recommendation", ""]
    noise = step_noise(records)
    fits = [r for r in ok if budget is None or (r.get("peak_tracked_bytes") or math.inf) <= budget]
    where = f"fits {budget / GIB:.2f} GiB (tracked peak)" if budget else "runs (no budget given)"
    if fits:
        lines += _fastest_lines(fits, noise, where, within)
    else:
        peaks = [r["peak_tracked_bytes"] for r in ok if r.get("peak_tracked_bytes")]
        smallest_peak = f"the smallest peak is {peak_text(min(peaks))}" if peaks else "no row has a tracked peak"
        lines.append(f"- No row {where}; {smallest_peak}.")
    lines += _step_noise_lines(noise)
    lines += _ppl_lines(ok, rows)
    lines.append("")
    return lines


def peak_text(n: float) -> str:
    """A peak as the recommendation states it: GiB to 3 decimals, as the table's column has it,
    from 10 MiB up; a smaller one in MiB or KiB, where 3 decimals of GiB read 0.001 for every row
    of a small model (1.10 MiB and 0.82 MiB alike) and named no difference."""
    if n >= 0.01 * GIB:
        return f"{n / GIB:.3f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.2f} KiB"


def _peak(r: dict[str, Any]) -> float:
    return r.get("peak_tracked_bytes") or math.inf


def _spread(r: dict[str, Any]) -> str:
    lo, hi = r.get("step_time_p10_s"), r.get("step_time_p90_s")
    return f" (p10-p90 {lo:.3f}-{hi:.3f})" if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else ""


def _fastest_lines(fits: list[dict[str, Any]], noise: Optional[dict[str, Any]], where: str, within: float) -> list[str]:
    """The fastest fitting row, or the rows equally fast within noise and the one of them with the
    smallest peak; then the smallest memory within ``within`` of that step time."""
    fastest = min(fits, key=lambda r: r["step_time_s"])
    tied = sorted((r for r in fits if not faster_beyond_noise(fastest, r, noise)), key=lambda r: r["step_time_s"])
    if len(tied) == 1:
        pick = fastest
        lines = [f"- Fastest row that {where}: **{method_cell(pick)}**, {pick['step_time_s']:.3f} s/step{_spread(pick)}, "
                 f"peak {peak_text(pick['peak_tracked_bytes'])}."]
    else:
        pick = min(tied, key=_peak)
        names = ", ".join(f"{method_cell(r)} ({r['step_time_s']:.3f} s/step)" for r in tied)
        lines = [f"- Fastest rows that {where.replace('fits', 'fit', 1)}: {names} are equally fast within noise; "
                 "of them the smallest tracked "
                 f"peak: **{method_cell(pick)}**, {pick['step_time_s']:.3f} s/step{_spread(pick)}, "
                 f"peak {peak_text(pick['peak_tracked_bytes'])}."]
    # By identity: `r in tied` compared dicts one by one, quadratic in the rows (30,000 rows of a
    # results file took it 14 s).
    tied_ids = {id(r) for r in tied}
    near = [r for r in fits if r["step_time_s"] <= fastest["step_time_s"] * (1 + within) or id(r) in tied_ids]
    smallest = min(near, key=_peak)
    or_noise = " or within noise of it" if len(tied) > 1 else ""
    lines.append(f"- Smallest memory within {within:.0%} of that step time{or_noise}: **{method_cell(smallest)}**, "
                 f"peak {peak_text(smallest['peak_tracked_bytes'])}, {smallest['step_time_s']:.3f} s/step.")
    return lines


def _step_noise_lines(noise: Optional[dict[str, Any]]) -> list[str]:
    ranges = "the two rows' p10-p90 step-time ranges (Step p10-p90 column) do not overlap"
    if noise is None:
        return [f"- Step-time noise: no row was timed twice (a noise twin such as `baseline{NUDGE_SUFFIX}1`, which the "
                f"default list adds, times its row again); a row counts as faster than another only when {ranges}."]
    twins = ", ".join(f"`{name}` {step:.3f}" for name, step in noise["twins"])
    return [f"- Step-time noise: `{noise['base']}` and its twins, the same computation, took {noise['step']:.3f} "
            f"({twins}) s/step, at most {fmt_noise(noise['rel_noise'])} apart; a row counts as faster than another "
            f"only when its median step beats the other's by more than {FACTOR:.0f}x that and {ranges}."]


def _ppl_lines(ok: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[str]:
    """Which rows' perplexity differs beyond noise: against the spread of a row and its twins where
    twins ran (the same figure as the noise section), else against the rounding spread of rows
    that compute the same function."""
    q = quality_vs_noise(rows)
    if q is not None:
        labels = {r.get("technique"): method_cell(r) for r in ok}
        base = labels.get(q["base"], q["base"])
        if q["rel_noise"] == 0 and not any(y["rel_noise"] > 0 for y in q.get("yardsticks") or []):
            moved = [f"{labels.get(r['technique'], r['method'])} ({r['rel_diff'] * 100:+.2f}%)" for r in q["rows"]
                     if r["rel_diff"] != 0 and not is_noise_twin(r["technique"])]
            return [f"- Perplexity: the noise could not be measured (the twins of {base} matched it to the digit: "
                    f"a run this short); differences from it, unjudged: {', '.join(moved) or 'none'}."]
        beyond = [f"{labels.get(r['technique'], r['method'])} ({r['rel_diff'] * 100:+.2f}%)" for r in q["rows"]
                  if r["beyond_noise"] and not is_noise_twin(r["technique"])]
        what = "nudged twins' spread" if q["kind"] == "nudge" else "seed-to-seed difference"
        others = "".join(f"; {y['precision']} rows: {fmt_noise(y['rel_noise'])}, `{y['base']}`'s twins"
                         for y in q.get("yardsticks") or [] if y["rel_noise"] > q["rel_noise"])
        return [f"- Perplexity differences beyond noise (vs {base}; more than {q['factor']:.0f}x the {what} "
                f"of {fmt_noise(q['rel_noise'])}{others}, see the noise section): {', '.join(beyond) or 'none'}."]
    noise = same_function_loss_spread(rows)
    by_tech = {r.get("technique"): r for r in rows}
    ref = ok[0]
    ref_loss = (by_tech.get(ref["technique"]) or {}).get("val_loss")
    if noise is None or ref_loss is None:
        return ["- Perplexity: no noise estimate (no two rows compute the same function); "
                "differences below a few tenths of a percent may be rounding."]
    beyond = []
    for r in ok[1:]:
        loss = (by_tech.get(r["technique"]) or {}).get("val_loss")
        if loss is not None and abs(loss - ref_loss) > noise:
            beyond.append(f"{method_cell(r)} ({math.exp(min(loss, 50)) / math.exp(min(ref_loss, 50)) - 1:+.2%})")
    text = ", ".join(beyond) if beyond else "none"
    return [f"- Perplexity differences beyond noise (vs {method_cell(ref)}; noise {math.exp(noise) - 1:.3%} in PPL, the "
            f"largest spread between rows that compute the same function): {text}."]
