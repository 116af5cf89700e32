"""Run-to-run noise of validation perplexity, and which rows' PPL differences exceed it.

A bench row ``X-seed2`` is row ``X`` again with the next seed (other initial weights, dropout
masks and batch order). Their relative PPL difference is the seed-to-seed noise of this setup;
every other row's PPL is compared with ``X``'s in the same relative terms. One extra seed gives
the scale of the noise, not a confidence interval, so a difference is called beyond noise only
when it is more than ``FACTOR`` times the seed-to-seed difference. The rows share ``X``'s seed,
initial weights and batch order, so a technique's own effect is measured against less noise than
this; the seed difference is the conservative yardstick.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["FACTOR", "validation_sample", "ppl_noise", "quality_vs_noise", "noise_markdown", "is_noise_twin", "fmt_noise",
           "step_noise", "faster_beyond_noise"]

FACTOR = 2.0
SUFFIX = "-seed2"


def is_noise_twin(name: Any) -> bool:
    """Whether bench row ``name`` is another row's next-seed twin (there to measure noise, never a
    technique to recommend)."""
    return isinstance(name, str) and name.endswith(SUFFIX)


def fmt_noise(rel: float) -> str:
    """A relative noise figure as the report writes it everywhere (one rounding for one figure)."""
    return f"{rel * 100:.2f}%"


def _ppl(row: dict[str, Any]) -> Optional[float]:
    v = row.get("val_ppl")
    return float(v) if row.get("status") == "ok" and isinstance(v, (int, float)) and v > 0 else None


def ppl_noise(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The first ``X`` / ``X-seed2`` pair with both PPLs: {base, ppl, ppl_seed2, rel_noise}."""
    by_name = {r.get("technique"): r for r in rows}
    for name, row in by_name.items():
        if not isinstance(name, str) or not name.endswith(SUFFIX):
            continue
        base = by_name.get(name[: -len(SUFFIX)])
        a, b = (_ppl(base) if base else None), _ppl(row)
        if a and b:
            return {"base": name[: -len(SUFFIX)], "ppl": a, "ppl_seed2": b, "rel_noise": abs(b / a - 1)}
    return None


def quality_vs_noise(rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """Each row's PPL relative to the noise pair's base row, and its size in units of the noise."""
    noise = ppl_noise(rows)
    if noise is None:
        return None
    out = []
    for r in rows:
        name, ppl = r.get("technique"), _ppl(r)
        if ppl is None or name in (noise["base"], noise["base"] + SUFFIX):
            continue
        rel = ppl / noise["ppl"] - 1
        times = abs(rel) / noise["rel_noise"] if noise["rel_noise"] > 0 else None
        beyond = (times is not None and times > FACTOR) or (times is None and rel != 0)
        out.append({"technique": name, "method": r.get("description") or name, "val_ppl": ppl,
                    "rel_diff": rel, "times_noise": times, "beyond_noise": beyond})
    return {**noise, "factor": FACTOR, "rows": out}


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
    return (f" The twin differs from `{base}` in its seed only (other initial weights and batch order); both, "
            f"and every row, are evaluated on the same {sample[0]} validation blocks ({sample[1]:,} tokens).")


def noise_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The report's "Quality against run-to-run noise" section (empty without a noise pair)."""
    q = quality_vs_noise(rows)
    if q is None:
        return []
    lines = [
        "## Quality against run-to-run noise",
        "",
        f"Run-to-run noise: `{q['base']}` reached val PPL {q['ppl']:.2f}; the same row with the next seed "
        f"(`{q['base']}{SUFFIX}`) {q['ppl_seed2']:.2f}, a {fmt_noise(q['rel_noise'])} difference."
        f"{_sample_sentence(rows, q['base'])} "
        f"A row's PPL difference from `{q['base']}` counts as beyond noise when it is more than "
        f"{q['factor']:.0f}x that.",
        "",
        "| Method | Val PPL | vs " + q["base"] + " | x noise | beyond noise? |",
        "|---|---:|---:|---:|---|",
    ]
    for r in q["rows"]:
        times = "n/a" if r["times_noise"] is None else f"{r['times_noise']:.1f}"
        lines.append(f"| {r['method']} | {r['val_ppl']:.2f} | {r['rel_diff'] * 100:+.2f}% | {times} | "
                     f"{'yes' if r['beyond_noise'] else 'no'} |")
    lines.append("")
    return lines


# ----------------------------------------------------------------------------- step time
# The twin pair is also the same computation timed twice, at two moments of the bench: the
# difference of its step times is the run-to-run timing noise of this machine while the bench
# ran (other processes sharing the cores, clock changes). A row's own spread is its p10-p90 range
# over the timed steps. One row is called faster than another only when its median step beats the
# other's by more than FACTOR times the twin's difference AND the two rows' p10-p90 ranges do not
# overlap; otherwise the two are equally fast within noise.

def _step(rec: dict[str, Any]) -> Optional[float]:
    v = rec.get("step_time_s")
    return float(v) if rec.get("status") == "ok" and isinstance(v, (int, float)) and v > 0 else None


def step_noise(records: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The first ``X`` / ``X-seed2`` pair of table records with both step times:
    {base, step, step_seed2, rel_noise}, ``rel_noise`` being the slower over the faster, minus 1
    (symmetric: which of two timings of one computation is the reference is arbitrary)."""
    by_name = {r.get("technique"): r for r in records}
    for name, rec in by_name.items():
        if not isinstance(name, str) or not is_noise_twin(name):
            continue
        base = by_name.get(name[: -len(SUFFIX)]) or {}
        a, b = _step(base), _step(rec)
        if a and b:
            return {"base": name[: -len(SUFFIX)], "step": a, "step_seed2": b, "rel_noise": max(a, b) / min(a, b) - 1}
    return None


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
