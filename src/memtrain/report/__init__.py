"""Reports from bench results: tables (Markdown, CSV, JSON) and plots (PNG).

``write_report(out)`` rebuilds everything from ``out/results.jsonl``; ``memtrain report DIR``
calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memtrain.report.plots import write_plots
from memtrain.report.tables import csv_text, markdown_report, table_rows
from memtrain.results import dumps, read_results_counted, select_rows


def write_report(out: Path, techniques: Optional[list[str]] = None, plots: bool = True) -> dict[str, Any]:
    """Write report.md, report.csv, report.json and (``plots``) PNG plots into ``out``; return a
    summary. The plots are most of the cost (matplotlib's savefig, ~1.5 s): the bench redraws
    them once at its end rather than after every row."""
    out = Path(out)
    read = read_results_counted(out)
    rows = select_rows(read.rows, techniques)
    present = {r.get("technique") for r in rows}
    missing = [t for t in (techniques or []) if t not in present]
    records = table_rows(rows)
    (out / "report.md").write_text(markdown_report(rows, missing) + "\n")
    (out / "report.csv").write_text(csv_text(records))
    (out / "report.json").write_text(dumps({"partial": bool(missing), "missing": missing, "rows": records}, indent=2) + "\n")
    drawn = write_plots(records, out) if plots else []
    return {"rows": len(rows), "missing": missing, "plots": [str(p) for p in drawn], "skipped_lines": read.skipped}
