"""The ``--memory-by-module`` table as text: the top entries at the peak and "other".

A table (``memory.by_module`` of a result, ``by_module`` of ``memtrain estimate --json``) is
``{"depth", "peak_bytes", "peak_phase", "modules": [{"module", "bytes", <category>: bytes}]}``
with every owner at the peak, largest first (:mod:`memtrain.metrics.by_module`); the entries
sum to the peak. Shown here: the first ``top`` and one "other" line summing the rest, in the
categories that hold any bytes.
"""

from __future__ import annotations

from typing import Any, Callable

from memtrain.techniques.facts import MEMORY_CATEGORIES

__all__ = ["OTHER", "is_module_table", "module_markdown", "module_table_lines", "top_entries"]

OTHER = "other"


def top_entries(table: dict[str, Any], top: int) -> list[dict[str, Any]]:
    """The first ``top`` entries, then one ``other`` entry summing the rest (when there is any)."""
    modules = list(table.get("modules") or [])
    shown, rest = modules[:top], modules[top:]
    if rest:
        other: dict[str, Any] = {"module": f"{OTHER} ({len(rest)})", "bytes": sum(r["bytes"] for r in rest)}
        for c in MEMORY_CATEGORIES:
            other[c] = sum(r.get(c, 0) for r in rest)
        shown.append(other)
    return shown


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    """The categories that hold bytes in ``rows`` (an all-zero column says nothing)."""
    return [c for c in MEMORY_CATEGORIES if any(r.get(c) for r in rows)]


def _title(table: dict[str, Any], top: int, fmt: Callable[[float], str]) -> str:
    n = len(table.get("modules") or [])
    peak = table.get("peak_bytes")
    at = f"the tracked peak of {fmt(peak)}" if isinstance(peak, (int, float)) else "the tracked peak"
    return (f"memory by module at {at} ({table.get('peak_phase') or 'no'} phase), depth {table.get('depth')}, "
            f"top {min(top, n)} of {n}")


def module_table_lines(table: dict[str, Any], top: int, fmt: Callable[[float], str]) -> list[str]:
    """The table as aligned text lines (``fmt`` writes a byte count), title first."""
    rows = top_entries(table, top)
    cols = _columns(rows)
    cells = [["module", "total", *cols]]
    cells += [[r["module"], fmt(r["bytes"]), *(fmt(r[c]) if r[c] else "-" for c in cols)] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = [_title(table, top, fmt) + ":"]
    for row in cells:
        lines.append("  " + "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                                      for i, (cell, w) in enumerate(zip(row, widths))))
    return lines


def is_module_table(table: Any) -> bool:
    """Whether ``table`` has the shape above (a results file is read, not trusted)."""
    if not isinstance(table, dict) or not isinstance(table.get("modules"), list):
        return False
    return all(isinstance(r, dict) and isinstance(r.get("module"), str)
               and all(isinstance(r.get(k), (int, float)) for k in ("bytes", *MEMORY_CATEGORIES))
               for r in table["modules"])


def module_markdown(label: str, table: dict[str, Any], top: int) -> list[str]:
    """One bench row's table in Markdown (MiB), under a line naming the row. ``label`` and the
    table's strings are written as given: the caller made them literal Markdown text
    (:func:`memtrain.report.tables.markdown_safe`)."""
    rows = top_entries(table, top)
    cols = _columns(rows)
    mib = 2**20
    lines = [f"**{label}**: {_title(table, top, lambda n: f'{n / mib:.2f} MiB')}", "",
             "| Module | Total (MiB) | " + " | ".join(f"{c.capitalize()} (MiB)" for c in cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    for r in rows:
        lines.append(f"| {r['module']} | {r['bytes'] / mib:.2f} | " + " | ".join(f"{r[c] / mib:.2f}" for c in cols) + " |")
    return lines + [""]
