"""The bench report's closing recommendation and its reading aids: pure functions of records.

* A max batch whose search never failed hit the search's cap: it is a lower bound ("256+").
* A memory category that is zero at the peak in every row is hidden, with the reason; a zero in
  some rows is explained by the phase the peak fell in.
* The recommendation: the fastest row that fits the budget, the smallest-memory row within
  ``within`` of the fastest, and which rows' perplexity differs from the first row's by more
  than the noise measured between rows that compute the same function.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from memtrain.numerics import numerics_key

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


def ppl_noise(rows: list[dict[str, Any]]) -> Optional[float]:
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
    """The report's closing section (Markdown lines)."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("step_time_s")]
    if not ok:
        return []
    lines = ["## Recommendation", ""]
    fits = [r for r in ok if budget is None or (r.get("peak_tracked_bytes") or math.inf) <= budget]
    where = f"fits {budget / GIB:.2f} GiB (tracked peak)" if budget else "runs (no budget given)"
    if fits:
        fastest = min(fits, key=lambda r: r["step_time_s"])
        lines.append(f"- Fastest row that {where}: **{fastest['method']}**, {fastest['step_time_s']:.3f} s/step, "
                     f"peak {fastest['peak_tracked_bytes'] / GIB:.3f} GiB.")
        near = [r for r in fits if r["step_time_s"] <= fastest["step_time_s"] * (1 + within)]
        smallest = min(near, key=lambda r: r.get("peak_tracked_bytes") or math.inf)
        lines.append(f"- Smallest memory within {within:.0%} of that step time: **{smallest['method']}**, "
                     f"peak {smallest['peak_tracked_bytes'] / GIB:.3f} GiB, {smallest['step_time_s']:.3f} s/step.")
    else:
        peaks = [r["peak_tracked_bytes"] for r in ok if r.get("peak_tracked_bytes")]
        smallest_peak = f"the smallest peak is {min(peaks) / GIB:.3f} GiB" if peaks else "no row has a tracked peak"
        lines.append(f"- No row {where}; {smallest_peak}.")
    noise = ppl_noise(rows)
    by_tech = {r.get("technique"): r for r in rows}
    ref = ok[0]
    ref_loss = (by_tech.get(ref["technique"]) or {}).get("val_loss")
    if noise is None or ref_loss is None:
        lines.append("- Perplexity: no noise estimate (no two rows compute the same function); "
                     "differences below a few tenths of a percent may be rounding.")
    else:
        beyond = []
        for r in ok[1:]:
            loss = (by_tech.get(r["technique"]) or {}).get("val_loss")
            if loss is not None and abs(loss - ref_loss) > noise:
                beyond.append(f"{r['method']} ({math.exp(min(loss, 50)) / math.exp(min(ref_loss, 50)) - 1:+.2%})")
        noise_pct = math.exp(min(noise, 50)) - 1
        text = ", ".join(beyond) if beyond else "none"
        lines.append(f"- Perplexity differences beyond noise (vs {ref['method']}; noise {noise_pct:.3%} in PPL, the "
                     f"largest spread between rows that compute the same function): {text}.")
    lines.append("")
    return lines
