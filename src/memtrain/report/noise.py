"""Run-to-run noise of validation perplexity, and which rows' PPL differences exceed it.

Two kinds of noise twin, named after the row they repeat:

* ``X-nudgeN`` (N = 1-99): row ``X`` with every initial weight moved by about one rounding
  (``--nudge-seed N``, :mod:`memtrain.training.nudge`). Every bench row shares ``X``'s seed:
  its initial weights, batch order and validation blocks. What still separates two rows that
  compute the same thing in another order (checkpointing, a fused kernel) is a rounding-size
  difference grown over the steps, which is what the nudged twins measure. The noise is the
  largest relative PPL difference among ``X`` and its nudged twins; a row whose difference from
  ``X`` is more than ``FACTOR`` times that changed the run beyond rounding: its technique's own
  effect on this run (not a claim about other seeds).
* ``X-seed2``: row ``X`` with the next seed (other initial weights, dropout masks and batch
  order): how much one run's PPL says about the setup. It is the yardstick only where no nudged
  twin ran; it is larger, the rows being compared sharing the seed, so it is the conservative one.

One or two extra runs give the scale of the noise, not a confidence interval, hence the factor.

Rounding noise depends on the precision a row computes in: two BF16 runs one rounding apart can
end much farther apart than two FP32 runs (at the quick scale on one CPU, 15% against 0.8%). Where
twins of rows in several precisions ran, each row is judged against the twins that compute in its
own precision, never against less than the first yardstick (:func:`row_noise`); the default bench
runs nudged twins of its FP32 baseline and of its BF16 ``flash-bf16`` row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from memtrain.report.labels import ppl_header

__all__ = ["FACTOR", "SEED_SUFFIX", "NUDGE_SUFFIX", "Twin", "twin_of", "validation_sample", "ppl_noise",
           "row_precision", "precision_yardsticks", "yardstick", "row_noise", "quality_vs_noise", "noise_markdown",
           "is_noise_twin", "fmt_noise", "step_noise", "faster_beyond_noise"]

FACTOR = 2.0
SEED_SUFFIX = "-seed2"
NUDGE_SUFFIX = "-nudge"  # followed by the nudge seed, 1-99
_NUDGE = re.compile(rf"^(?P<base>.+){re.escape(NUDGE_SUFFIX)}(?P<n>[1-9][0-9]?)$")


@dataclass(frozen=True)
class Twin:
    """What a noise twin's row name says: the row it repeats and how it differs from it."""

    base: str
    kind: str  # "nudge" (initial weights one rounding apart) or "seed" (the next seed)
    nudge_seed: int = 0  # the nudge twin's --nudge-seed; 0 for a seed twin


def twin_of(name: Any) -> Optional[Twin]:
    """The twin ``name`` spells (``X-nudgeN`` or ``X-seed2``), or None for any other row."""
    if not isinstance(name, str):
        return None
    m = _NUDGE.match(name)
    if m:
        return Twin(m["base"], "nudge", int(m["n"]))
    if name.endswith(SEED_SUFFIX) and len(name) > len(SEED_SUFFIX):
        return Twin(name[: -len(SEED_SUFFIX)], "seed")
    return None


def is_noise_twin(name: Any) -> bool:
    """Whether bench row ``name`` is another row's noise twin (there to measure noise, never a
    technique to recommend)."""
    return twin_of(name) is not None


def fmt_noise(rel: float) -> str:
    """A relative noise figure as the report writes it everywhere (one rounding for one figure)."""
    return f"{rel * 100:.2f}%"


def _ppl(row: dict[str, Any]) -> Optional[float]:
    v = row.get("val_ppl")
    return float(v) if row.get("status") == "ok" and isinstance(v, (int, float)) and v > 0 else None


def _spread(values: list[float]) -> float:
    """The largest relative difference among ``values``: largest over smallest, minus 1
    (symmetric: which of two runs of one computation is the reference is arbitrary)."""
    return max(values) / min(values) - 1


def _twin_groups(rows: list[dict[str, Any]], value: Callable[[dict[str, Any]], Optional[float]],
                 kind: Optional[str]) -> list[dict[str, Any]]:
    """Per base row with twins of ``kind`` (any kind: None), in row order: {base, value, twins:
    [(name, value)]}, only twins and bases whose ``value(row)`` is known."""
    by_name = {r.get("technique"): r for r in rows}
    groups: dict[str, dict[str, Any]] = {}
    for name, row in by_name.items():
        twin = twin_of(name)
        if twin is None or kind not in (None, twin.kind) or twin.base not in by_name:
            continue
        a, b = value(by_name[twin.base]), value(row)
        if a and b:
            groups.setdefault(twin.base, {"base": twin.base, "value": a, "twins": []})["twins"].append((name, b))
    return list(groups.values())


def ppl_noise(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The PPL noise the report judges rows by: the first row with nudged twins (else with a
    seed twin) and both PPLs: {base, kind, ppl, twins: [(name, ppl)], rel_noise}, ``rel_noise``
    being the largest relative difference among the base and its twins; with ``seed`` (the
    seed-to-seed figure of the same base, when a seed twin ran beside nudged ones) for reference."""
    for kind in ("nudge", "seed"):
        groups = _twin_groups(rows, _ppl, kind)
        if groups:
            g = groups[0]
            out = {"base": g["base"], "kind": kind, "ppl": g["value"], "twins": g["twins"],
                   "rel_noise": _spread([g["value"]] + [v for _, v in g["twins"]])}
            if kind == "nudge":
                seed = [s for s in _twin_groups(rows, _ppl, "seed") if s["base"] == g["base"]]
                if seed:
                    out["seed"] = {"twins": seed[0]["twins"],
                                   "rel_noise": _spread([g["value"]] + [v for _, v in seed[0]["twins"]])}
            return out
    return None


def row_precision(row: dict[str, Any]) -> Optional[str]:
    """The ``--precision`` a result row ran in (after any substitution), where it says (a
    results file is read, not trusted: anything else there is no precision)."""
    config = row.get("config")
    technique = config.get("technique") if isinstance(config, dict) else None
    precision = technique.get("precision") if isinstance(technique, dict) else None
    return precision if isinstance(precision, str) else None


def precision_yardsticks(rows: list[dict[str, Any]], noise: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nudged twin groups (else the seed twin groups) past the first, one per precision not
    yet covered: {base, precision, twins: [(name, ppl)], rel_noise} for rows computing in
    ``precision``, ``rel_noise`` being the largest relative difference among the base and its
    twins (see :func:`row_noise`). ``noise``: :func:`ppl_noise` of ``rows``, which the caller has."""
    if noise is None:
        return []
    by_name = {r.get("technique"): r for r in rows}
    seen = {row_precision(by_name.get(noise["base"], {}))}
    out = []
    for g in _twin_groups(rows, _ppl, noise["kind"]):
        precision = row_precision(by_name.get(g["base"], {}))
        if precision is None or precision in seen:
            continue
        seen.add(precision)
        out.append({"base": g["base"], "precision": precision, "ppl": g["value"], "twins": g["twins"],
                    "rel_noise": _spread([g["value"]] + [v for _, v in g["twins"]])})
    return out


def yardstick(noise: dict[str, Any], yardsticks: list[dict[str, Any]], precision: Optional[str]) -> tuple[str, float]:
    """(base row, relative noise) for a row in ``precision``, from :func:`ppl_noise`'s ``noise``
    and :func:`precision_yardsticks`' ``yardsticks`` (see :func:`row_noise`); for judging many rows
    of one results file without searching its twins again for each."""
    own = next((y for y in yardsticks if y["precision"] == precision), None)
    if own is None or own["rel_noise"] <= noise["rel_noise"]:
        return noise["base"], noise["rel_noise"]
    return own["base"], own["rel_noise"]


def row_noise(rows: list[dict[str, Any]], precision: Optional[str]) -> Optional[tuple[str, float]]:
    """(the yardstick's base row, its relative noise) for a row computing in ``precision``: the
    twins of that precision where they ran, never less than the first yardstick
    (:func:`ppl_noise`, which judges every other row); None without twins."""
    noise = ppl_noise(rows)
    return None if noise is None else yardstick(noise, precision_yardsticks(rows, noise), precision)


def quality_vs_noise(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Each row's PPL relative to the noise's base row, and its size in units of its yardstick's
    noise (:func:`row_noise`: the twins of its own precision where they ran)."""
    noise = ppl_noise(rows)
    if noise is None:
        return None
    yardsticks = precision_yardsticks(rows, noise)
    out = []
    for r in rows:
        name, ppl = r.get("technique"), _ppl(r)
        if ppl is None or name == noise["base"] or is_noise_twin(name):
            continue
        rel = ppl / noise["ppl"] - 1
        noise_base, rel_noise = yardstick(noise, yardsticks, row_precision(r))
        # Twins equal to the digit measured no noise (a run too short for a rounding to grow):
        # there is no yardstick, so no row is called beyond or within it (None).
        times = abs(rel) / rel_noise if rel_noise > 0 else None
        beyond = None if times is None else times > FACTOR
        out.append({"technique": name, "method": r.get("description") or name, "val_ppl": ppl,
                    "rel_diff": rel, "noise_base": noise_base, "rel_noise": rel_noise, "times_noise": times,
                    "beyond_noise": beyond})
    return {**noise, "factor": FACTOR, "rows": out, "yardsticks": yardsticks}


def validation_sample(row: dict[str, Any]) -> Optional[tuple[int, int]]:
    """(blocks, tokens) the row's validation PPL was measured on: ``--val-blocks`` blocks of
    ``--seq-len`` tokens, fewer where the held-out split has fewer (each block takes seq-len + 1
    tokens, the targets being shifted by one); None where the row does not say."""
    blocks = ((row.get("config") or {}).get("data") or {}).get("val_blocks")
    seq = ((row.get("config") or {}).get("train") or {}).get("seq_len")
    held_out = (row.get("data") or {}).get("val_tokens")
    if not (isinstance(blocks, int) and isinstance(seq, int) and isinstance(held_out, int)
            and min(blocks, seq, held_out) > 0):
        return None
    n = min(blocks, held_out // (seq + 1))
    return n, n * seq


def _sample_sentence(rows: list[dict[str, Any]], base: str) -> str:
    row = next((r for r in rows if r.get("technique") == base), {})
    sample = validation_sample(row)
    if sample is None:
        return ""
    return f" on the same {sample[0]} validation blocks ({sample[1]:,} tokens)"


def _twin_list(twins: list[tuple[str, float]]) -> str:
    return ", ".join(f"`{name}` {ppl:.2f}" for name, ppl in twins)


def _noise_paragraph(q: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    base, sample = q["base"], _sample_sentence(rows, q["base"])
    rule = (f"A row's PPL difference from `{base}` counts as beyond noise when it is more than "
            f"{q['factor']:.0f}x that")
    if q["kind"] == "seed":
        return (f"Run-to-run noise: `{base}` reached val PPL {q['ppl']:.2f}; the same row with the next seed "
                f"({_twin_list(q['twins'])}), a {fmt_noise(q['rel_noise'])} difference. The twin differs from "
                f"`{base}` in its seed only (other initial weights and batch order); both, and every row, are "
                f"evaluated{sample or ' alike'}. {rule}.")
    text = (f"Run-to-run noise: `{base}` reached val PPL {q['ppl']:.2f}; the same row with its initial weights "
            f"nudged by one rounding ({_twin_list(q['twins'])}): the largest difference among these "
            f"{len(q['twins']) + 1} runs is "
            f"{fmt_noise(q['rel_noise'])}. Every row shares `{base}`'s seed (initial weights, batch order) and is "
            f"evaluated{sample or ' alike'}, so what separates `{base}` from a row that computes the same thing in "
            f"another order (checkpointing, another attention kernel) is a rounding-size difference grown over the "
            f"steps, which is what the nudged twins measure. {rule}: the technique changed this run beyond rounding "
            f"(a statement about this seed, not about every seed).")
    if q["rel_noise"] == 0:
        text += (" The twins' PPL equals the baseline's to the digit: in a run this short a rounding did not grow, "
                 "so the noise could not be measured and no row is judged against it (\"beyond noise?\" reads "
                 "\"unknown\"); more steps (the default 200 per epoch) give the yardstick.")
    for y in q.get("yardsticks") or []:
        kind = "nudged twin" + ("s" if len(y["twins"]) > 1 else "") if q["kind"] == "nudge" else "seed twin"
        text += (f" Rounding grows otherwise in another precision: rows computing in {y['precision']} are judged "
                 f"against `{y['base']}` ({y['ppl']:.2f}) and its {kind} ({_twin_list(y['twins'])}), "
                 f"{fmt_noise(y['rel_noise'])} apart (no less than the figure above; the table's noise column).")
    seed = q.get("seed")
    if seed:
        text += (f" Seed-to-seed, for reference: {_twin_list(seed['twins'])} (other initial weights and batch "
                 f"order), {fmt_noise(seed['rel_noise'])} from `{base}`: how far one run's PPL lies from another "
                 "seed's, not the yardstick here since the rows share the seed.")
    else:
        text += (f" The spread over seeds (other initial weights and batch order) is not measured here: add "
                 f"`{base}{SEED_SUFFIX}` to --techniques for it.")
    return text


def noise_markdown(rows: list[dict[str, Any]], labels: Optional[dict[str, str]] = None) -> list[str]:
    """The report's "Quality against run-to-run noise" section (empty without a noise twin).
    ``labels``: a row's name as the report's other tables write it (with what ran in its place)."""
    q = quality_vs_noise(rows)
    if q is None:
        return []
    lines = [
        "## Quality against run-to-run noise",
        "",
        _noise_paragraph(q, rows),
        "",
        "| Method | " + ppl_header(rows) + " | vs " + q["base"] + " | noise | x noise | beyond noise? |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in q["rows"]:
        times = "n/a" if r["times_noise"] is None else f"{r['times_noise']:.1f}"
        verdict = "unknown" if r["beyond_noise"] is None else ("yes" if r["beyond_noise"] else "no")
        lines.append(f"| {(labels or {}).get(r['technique'], r['method'])} | {r['val_ppl']:.2f} | {r['rel_diff'] * 100:+.2f}% | "
                     f"{fmt_noise(r['rel_noise'])} | {times} | {verdict} |")
    lines.append("")
    return lines


# ----------------------------------------------------------------------------- step time
# A row and its noise twins (nudged or next-seed alike: the same computation) are also one
# computation timed several times, at several moments of the bench: the spread of their step
# times is the run-to-run timing noise of this machine while the bench ran (other processes
# sharing the cores, clock changes). A row's own spread is its p10-p90 range over the timed steps.
# One row is called faster than another only when its median step beats the other's by more than
# FACTOR times that noise AND the two rows' p10-p90 ranges do not overlap; otherwise the two are
# equally fast within noise.

def _step(rec: dict[str, Any]) -> Optional[float]:
    v = rec.get("step_time_s")
    return float(v) if rec.get("status") == "ok" and isinstance(v, (int, float)) and v > 0 else None


def step_noise(records: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The first row of table records timed again by its twins (every kind: the same computation):
    {base, step, twins: [(name, step)], rel_noise}, ``rel_noise`` the largest relative difference
    among those step times."""
    groups = _twin_groups(records, _step, None)
    if not groups:
        return None
    g = groups[0]
    return {"base": g["base"], "step": g["value"], "twins": g["twins"],
            "rel_noise": _spread([g["value"]] + [v for _, v in g["twins"]])}


def _range(rec: dict[str, Any]) -> Optional[tuple[float, float]]:
    lo, hi = rec.get("step_time_p10_s"), rec.get("step_time_p90_s")
    return (float(lo), float(hi)) if isinstance(lo, (int, float)) and isinstance(hi, (int, float)) else None


def faster_beyond_noise(fast: dict[str, Any], slow: dict[str, Any], noise: Optional[dict[str, Any]]) -> bool:
    """Whether table record ``fast`` is faster than ``slow`` by more than the measured noise: its
    median beats ``slow``'s by more than FACTOR x the twin's difference (when a twin was timed) and
    its p90 is below ``slow``'s p10 (when both ranges are known)."""
    a, b = _step(fast), _step(slow)
    if a is None or b is None or a >= b:
        return False
    if noise is not None and b / a - 1 <= FACTOR * noise["rel_noise"]:
        return False
    ra, rb = _range(fast), _range(slow)
    return not (ra and rb and ra[1] >= rb[0])
