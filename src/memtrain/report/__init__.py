"""Reports from bench results: tables (Markdown, CSV, JSON) and plots (PNG).

``write_report(out)`` rebuilds everything from ``out/results.jsonl``; ``memtrain report DIR``
calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memtrain.files.results import (
    PLOT_FILES,
    REPORT_FILES,
    JsonlRead,
    dumps,
    read_results_counted,
    refuse_odd_destination,
    select_rows,
    write_text_atomic,
)
from memtrain.report.plots import write_plots
from memtrain.report.tables import csv_text, markdown_report, table_rows


def write_report(out: Path, techniques: Optional[list[str]] = None, plots: bool = True,
                 read: Optional[JsonlRead] = None) -> dict[str, Any]:
    """Write report.md, report.csv, report.json and (``plots``) PNG plots into ``out``; return a
    summary. The plots are most of the cost (matplotlib's savefig, ~1.5 s): the bench redraws
    them once at its end rather than after every row. Every file is replaced atomically; a
    link (or a folder, device, FIFO) at any of their names is refused before any is written.
    ``read``: the rows of results.jsonl already read (and checked) by the caller."""
    out = Path(out)
    for name in REPORT_FILES + (PLOT_FILES if plots else ()):
        refuse_odd_destination(out / name, f"{str(out / name)!r}")
    if read is None:
        read = read_results_counted(out)
    rows = select_rows(read.rows, techniques)
    present = {r.get("technique") for r in rows}
    missing = [t for t in (techniques or []) if t not in present]
    records = table_rows(rows)
    md, csv, js = REPORT_FILES
    write_text_atomic(out / md, markdown_report(rows, missing) + "\n")
    write_text_atomic(out / csv, csv_text(records))
    write_text_atomic(out / js, dumps({"partial": bool(missing), "missing": missing, "rows": records}, indent=2) + "\n")
    drawn = write_plots(records, out) if plots else []
    return {"rows": len(rows), "missing": missing, "plots": [str(p) for p in drawn], "skipped_lines": read.skipped}
