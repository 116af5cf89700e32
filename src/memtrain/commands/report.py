"""`memtrain report DIR`: rebuild tables and plots from DIR/results.jsonl."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from memtrain.cli import register
from memtrain.commands.bench import warn_skipped_lines
from memtrain.config.argtypes import user_path
from memtrain.config.run import ConfigError
from memtrain.errors import one_line
from memtrain.files.bench_record import read_bench_records, unrun_benches
from memtrain.files.bench_store import bench_results_file, read_results_latest, row_settings
from memtrain.files.lock import FolderLock
from memtrain.files.results import BENCH_RESULTS
from memtrain.report import write_report
from memtrain.report.tables import unrun_sentence


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=user_path, help="A bench results folder (holding results.jsonl).")
    p.add_argument("--settings", default=None, metavar="ID",
                   help="Report the rows run under these bench settings (an ID the report names when "
                   "results.jsonl holds rows of several benches run otherwise; 'unrecorded': rows that "
                   "record none). Default: the settings of the row appended last. A report never "
                   "compares rows run under different settings.")


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    try:
        bench_results_file(out, "memtrain report")
    except ConfigError as exc:
        if out.is_dir() and not os.path.lexists(out / BENCH_RESULTS):  # not a FIFO or folder in its place
            raise ConfigError(_unrun_instead(out, str(exc))) from None
        raise
    # Held while the report is built: a bench still running in DIR writes its report at its end,
    # and ours, from the rows of the moment, could land after it and be the one left.
    with FolderLock(out, "memtrain report", flag="DIR", cleanup_if_unused=True):
        return _report(out, args)


def _report(out: Path, args: argparse.Namespace) -> int:
    # Read and check the rows before writing: a file with no rows must not replace a good report.
    # Streamed: only the latest row of each technique under each settings is kept.
    read = read_results_latest(out)
    if not read.rows:
        skipped = f" ({read.skipped} unreadable line(s) skipped)" if read.skipped else ""
        raise ConfigError(_unrun_instead(out, f"{out}/results.jsonl holds no rows{skipped}; run memtrain bench first"))
    if args.settings is not None:
        check_settings(out, read.rows, args.settings)
    summary = write_report(out, read=read, settings=args.settings)
    print((out / "report.md").read_text())
    warn_skipped_lines(out, summary)
    if summary["record_problem"]:  # the report is built all the same, from the rows' own lists
        print(f"warning: {one_line(summary['record_problem'])}; the rows' own lists name what is missing", file=sys.stderr)
    print(f"wrote {one_line(str(out))}/report.md, report.csv, report.json and {len(summary['plots'])} plots")
    return 0


def _unrun_instead(out: Path, error: str) -> str:
    """``error`` (results.jsonl missing, or holding no row), or, where the folder's bench record
    names benches that planned rows, what happened instead: they were interrupted before their
    first row was appended (the error's advice, "a folder that memtrain bench wrote" or "run
    memtrain bench first", would mislead), and what to do."""
    unrun = unrun_benches(read_bench_records(out).benches, set())
    if not unrun:
        return error
    what = error.split(";", 1)[0]  # the fact ("... not found", "... holds no rows"), without its advice
    return one_line(f"{what}: {unrun_sentence(unrun, str, str)}")


def check_settings(out: Path, rows: list[dict], settings: str) -> None:
    """Refuse a --settings ID that no row of ``out`` ran under, naming the ones there are."""
    known = list(dict.fromkeys(row_settings(r) for r in reversed(rows)))  # the latest first
    if settings not in known:
        shown = ", ".join(known[:5]) + (f" and {len(known) - 5} more" if len(known) > 5 else "")
        raise ConfigError(f"--settings {settings}: no row of {out}/results.jsonl ran under these settings; "
                          f"it holds {shown}")


register("report", "Rebuild the bench tables and plots from a results folder.", add_args, run)
