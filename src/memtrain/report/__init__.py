"""Reports from bench results: tables (Markdown, CSV, JSON) and plots (PNG).

``write_report(out)`` rebuilds everything from ``out/results.jsonl``; ``memtrain report DIR``
calls it. A report compares rows run under one set of bench settings (``settings_hash``): by
default those of the row appended last; rows under other settings are left out and named.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from memtrain.files.bench_record import (
    BenchRecords,
    UnrunBench,
    plans_no_row,
    read_bench_records,
    techniques_recorded,
    unrun_benches,
)
from memtrain.files.bench_store import (
    latest_settings,
    other_settings,
    read_results_latest,
    row_settings,
    rows_under,
    select_rows,
    techniques_asked,
)
from memtrain.files.json_text import dumps
from memtrain.files.results import (
    BENCH_RECORD,
    PLOT_FILES,
    REPORT_FILES,
    JsonlRead,
    drop_planted_link,
    refuse_odd_destination,
    write_text_atomic,
)
from memtrain.report.labels import answers_only
from memtrain.report.plots import write_plots
from memtrain.report.tables import csv_text, markdown_report, table_rows


def write_report(out: Path, techniques: Optional[list[str]] = None, plots: bool = True,
                 read: Optional[JsonlRead] = None, settings: Optional[str] = None,
                 replace_links: bool = False) -> dict[str, Any]:
    """Write report.md, report.csv, report.json and (``plots``) PNG plots into ``out``; return a
    summary. The plots are most of the cost (matplotlib's savefig, ~1.5 s): the bench redraws
    them once at its end rather than after every row. Every file is replaced atomically; a
    link (or a folder, device, FIFO) at any of their names is refused before any is written.
    ``read``: the rows of results.jsonl already read (and checked) by the caller. ``settings``:
    the settings id whose rows are reported (:func:`~memtrain.files.bench_store.row_settings`;
    default: those of the row appended last); the others are counted in one line.
    ``techniques``: the rows to report, in order, and those with no row named missing (default:
    every row under the settings; missing, those the rows' benches listed and never finished; and
    the benches of bench_record.json whose settings no row ran under, named in report.md's
    ``**Not run**`` line and report.json's ``unrun_benches``).
    ``replace_links``: a bench's own report, whose names it checked before its first row: a link
    planted there since is replaced (:func:`~memtrain.files.results.drop_planted_link`), rather
    than stopping the bench with rows left to run."""
    out = Path(out)
    for name in REPORT_FILES + (PLOT_FILES if plots else ()):
        if replace_links:
            drop_planted_link(out / name)
        refuse_odd_destination(out / name, f"{str(out / name)!r}")
    if read is None:
        read = read_results_latest(out)  # the latest row per technique and settings, as the report needs
    chosen = settings if settings is not None else latest_settings(read.rows)
    rows = select_rows(rows_under(read.rows, chosen), techniques)
    other = other_settings(read.rows, chosen)
    present = {r.get("technique") for r in rows}
    unrun: list[UnrunBench] = []
    if techniques is not None:  # a bench's own report: its own list
        asked, record_problem = techniques, None
    else:
        recorded = read_bench_records(out)
        asked, record_problem = _asked_in_folder(out, rows, chosen, recorded)
        unrun = unrun_benches(recorded.benches, {row_settings(r) for r in read.rows})
    missing = [t for t in asked if t not in present]
    records = table_rows(rows)
    md, csv, js = REPORT_FILES
    write_text_atomic(out / md, markdown_report(rows, missing, other=other, folder=str(out), unrun=unrun) + "\n")
    write_text_atomic(out / csv, csv_text(records))
    summary: dict[str, Any] = {"partial": bool(missing), "missing": missing, "rows": records}
    if other:  # only then is there a choice of settings to name
        summary = {"settings": chosen, "other_settings": [{"settings": sid, "techniques": t} for sid, t in other],
                   **summary}
    if unrun:  # only then is there a bench to name
        summary["unrun_benches"] = [asdict(u) for u in unrun]
    write_text_atomic(out / js, dumps(summary, indent=2) + "\n")
    drawn = write_plots(records, out, answers_only(rows)) if plots else []
    return {"rows": len(rows), "missing": missing, "plots": [str(p) for p in drawn], "skipped_lines": read.skipped,
            "settings": chosen, "other_settings": other, "record_problem": record_problem, "unrun_benches": unrun}


def _asked_in_folder(out: Path, rows: list[dict[str, Any]], settings: Optional[str],
                     records: BenchRecords) -> tuple[list[str], Optional[str]]:
    """What the benches of ``out`` under ``settings`` were asked to run (memtrain report DIR,
    which is given no list), and why the bench record (``records``) was not used, or None. The
    lists the rows' benches ran with (``bench_techniques``), then those of the recorded benches: a
    bench interrupted before it appended a row (its first rows found done) is named by its record
    only. A folder with no record (benched before it was written) is reported from its rows alone,
    as it was; a record that names no planned row is said, as an unreadable one is."""
    recorded = techniques_recorded(records.benches, settings)
    problem = records.problem
    if plans_no_row(records):
        problem = f"{str(out / BENCH_RECORD)!r} names no planned row (no bench, or only empty lists)"
    return list(dict.fromkeys(techniques_asked(rows) + recorded)), problem
