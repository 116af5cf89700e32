"""`memtrain report DIR`: rebuild tables and plots from DIR/results.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from memtrain.cli import register
from memtrain.commands.bench import warn_skipped_lines
from memtrain.config.argtypes import user_path
from memtrain.config.run import ConfigError
from memtrain.files.results import read_results_counted
from memtrain.report import write_report


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", type=user_path, help="A bench results folder (holding results.jsonl).")


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if not (out / "results.jsonl").is_file():
        raise ConfigError(f"{out}/results.jsonl not found; point memtrain report at a folder written by memtrain bench")
    # Read and check the rows before writing: a file with no rows must not replace a good report.
    read = read_results_counted(out)
    if not read.rows:
        skipped = f" ({read.skipped} unreadable line(s) skipped)" if read.skipped else ""
        raise ConfigError(f"{out}/results.jsonl holds no rows{skipped}; run memtrain bench first")
    summary = write_report(out, read=read)
    print((out / "report.md").read_text())
    warn_skipped_lines(out, summary)
    print(f"wrote {out}/report.md, report.csv, report.json and {len(summary['plots'])} plots")
    return 0


register("report", "Rebuild the bench tables and plots from a results folder.", add_args, run)
