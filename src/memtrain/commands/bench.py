"""`memtrain bench`: compare techniques side by side (each row in its own process)."""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any, Optional

from memtrain.bench.runner import (
    BenchOptions,
    bench_settings,
    check_row_folders,
    check_rows_data,
    resolve_rows,
    row_folder,
    run_bench,
    settings_hash,
)
from memtrain.bench.scales import DEFAULT_SCALE, SCALE_BUDGET, SCALE_MAX_BATCH, SCALES, scale_overrides
from memtrain.bench.technique_sets import (
    CUDA_DEFAULT_EXTRA,
    DEFAULT_TECHNIQUES,
    NOISE_ROWS,
    TECHNIQUES,
    default_techniques,
    noise_twin,
)
from memtrain.cli import add_config_flags, fmt_bytes, refuse_device_not_here, register
from memtrain.config.argtypes import batch_count, positive_float, rank_count, user_path
from memtrain.config.file import load_config_file
from memtrain.config.run import SECTIONS, ConfigError, parse_size
from memtrain.errors import one_line
from memtrain.files.results import OUT_FILES, TRAIN_FILES
from memtrain.report import write_report
from memtrain.report.labels import ppl_words
from memtrain.training.preflight import (
    check_folder_room,
    check_name_room,
    check_out_names,
    check_out_outside_data,
    check_writable_dir,
)


def warn_skipped_lines(out: Path, summary: dict) -> None:
    """Say on stderr how many lines of results.jsonl were unreadable (torn or not a row)."""
    if summary.get("skipped_lines"):
        print(f"warning: skipped {summary['skipped_lines']} unreadable line(s) of {out}/results.jsonl "
              "(torn by a kill or a full disk, or not a JSON object)", file=sys.stderr)


# Where the scale flags note each (flag, value) given: --preset beside a different --scale is refused.
SCALE_NAMED = "_scale_named"


class _ScaleName(argparse.Action):
    """--scale, or --preset (its name in the interface contract): sets the run scale and notes
    which flag said what, for :func:`resolve_scale`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        named = list(getattr(namespace, SCALE_NAMED, None) or [])
        named.append((option_string or "--scale", values))
        setattr(namespace, SCALE_NAMED, named)
        setattr(namespace, self.dest, values)


def resolve_scale(args: argparse.Namespace) -> str:
    """The run scale --scale or --preset named, checked before anything runs: --preset with a
    different --scale is refused, and so is a --preset value that is a technique preset (the
    rows' presets go to --techniques) or no scale at all."""
    named = getattr(args, SCALE_NAMED, None) or []
    presets = [value for flag, value in named if flag == "--preset"]
    if presets and len({value for _, value in named}) > 1:
        raise ConfigError(" and ".join(f"{flag} {value}" for flag, value in dict.fromkeys(named)) +
                          " name different scales (--preset is --scale's other name); give one of them")
    for value in presets:
        if value not in SCALES and (value in TECHNIQUES or noise_twin(value) is not None):
            raise ConfigError(f"--preset {value}: {value!r} is a technique preset, and --preset names the run scale "
                              f"({' or '.join(SCALES)}); use --techniques {value} for the rows and "
                              f"--scale {'|'.join(SCALES)} for the scale")
        if value not in SCALES:
            raise ConfigError(f"unknown scale {value!r} (--preset, --scale's other name); choose {' or '.join(SCALES)}")
    scale_overrides(args.scale)  # an unknown --scale: refused here, before the folder is made
    return str(args.scale)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scale", dest="scale", default=DEFAULT_SCALE, action=_ScaleName, metavar="SCALE",
                   help=f"Scale of every row (model, batch, sequence, steps): {' | '.join(SCALES)} "
                   f"(seed: the published table's settings; quick: minutes on 2 CPU cores). Default {DEFAULT_SCALE}.")
    p.add_argument("--preset", dest="scale", action=_ScaleName, metavar="SCALE", default=argparse.SUPPRESS,
                   help=f"The same as --scale ({' | '.join(SCALES)}): its name in memtrain's interface contract. "
                   "Technique presets go to --techniques.")
    p.add_argument("--techniques", default=None,
                   help=f"Comma-separated rows: presets ({', '.join(TECHNIQUES)}), a preset's noise twins "
                   "PRESET-nudgeN (the same row, its initial weights nudged by one rounding with --nudge-seed N, "
                   "N = 1-99) and PRESET-seed2 (the same row with the next seed), or explicit combinations "
                   "key=value+key=value (e.g. precision=bf16+loss=chunked). A flag "
                   "(e.g. --vocab-multiple) overrides a preset's own setting; an explicit row may not "
                   "set a key that a flag also sets, nor a --config file a preset's technique (refused, so neither "
                   "silently wins). "
                   f"Default: {','.join(DEFAULT_TECHNIQUES + NOISE_ROWS)} (on CUDA {', '.join(CUDA_DEFAULT_EXTRA)} too, before "
                   "the twins; fp8 only where the GPU has FP8 tensor cores); on a device without native "
                   "BF16 the default list runs its BF16 rows in the faster measured native precision (FP16 "
                   "where native and not measured slower than FP32, else FP32) and says so; rows named here "
                   "run as asked (with a warning).")
    p.add_argument("--out", dest="bench_out", type=user_path, default="runs/bench", help="Results folder (default runs/bench).")
    p.add_argument("--force", action="store_true", help="Rerun rows already in results.jsonl.")
    p.add_argument("--no-maxbatch", action="store_true", help="Skip the max-batch search of each row.")
    # --budget too, as estimate, plan and maxbatch take both names of the budget.
    p.add_argument("--memory-budget", "--budget", dest="memory_budget", default=None, metavar="SIZE",
                   help="Budget for the max-batch search, e.g. 8GiB "
                   "(default: the device's memory on CUDA; on CPU the scale's budget, "
                   f"{', '.join(f'{k} {v}' for k, v in SCALE_BUDGET.items() if v)}, else 1GiB, through the tracked meter).")
    p.add_argument("--max-batch", type=batch_count, default=None, help="Upper bound of the max-batch search (default: the scale's, "
                   + ", ".join(f"{k} {v}" for k, v in SCALE_MAX_BATCH.items()) + ").")
    p.add_argument("--multiple-of", type=batch_count, default=1, help="Max batch searched in multiples of this (e.g. 8; default 1).")
    p.add_argument("--row-timeout", type=positive_float, default=None, help="Seconds before a row is stopped and recorded as timeout (default: no limit).")
    p.add_argument("--nproc", type=rank_count, default=1, help="Processes (devices) per row, launched with torchrun; rows "
                   "run data-parallel with --distributed ddp unless they set distributed=zero1|zero2|fsdp. Default 1.")
    # A row logs no metrics (its result is its line in results.jsonl): no --report-to/--log-every.
    add_config_flags(p, ("data", "model", "train"), exclude=("out", "save", "resume", "save_every", "report_to",
                                                            "log_every"),
                     helps={"stop_after": "Stop each row after this many optimizer steps, its schedule still "
                                          "spanning --steps (a row saves no checkpoint).",
                            **SCALE_FLAG_HELPS})
    show_scale_defaults(p)


# The help of flags whose train help quotes train's own defaults (a 200-step run, its 200-step
# warm-up): a bench row runs its scale's (bench/scales.py), which show_scale_defaults appends.
SCALE_FLAG_HELPS = {
    "steps": "Optimizer steps of every row.",
    "warmup_steps": "Linear warm-up steps W up to --lr: step s (from 0) runs at (s + 1) / W of it, so the first "
                    "step already learns. When --steps is shorter than the scale's warm-up and no setting names "
                    "the warm-up, it is capped at 10%% of --steps (the rows would never reach --lr).",
}


def show_scale_defaults(p: argparse.ArgumentParser) -> None:
    """Each flag a scale sets shows the scale's values as its default (the config field's own
    default, e.g. batch 8, is not what a bench row runs)."""

    field_defaults = {f.name: f.default for cls in SECTIONS.values() for f in fields(cls)}
    for action in p._actions:
        if action.help in (None, argparse.SUPPRESS) or not any(action.dest in scale for scale in SCALES.values()):
            continue
        order = sorted(SCALES, key=lambda name: name != DEFAULT_SCALE)  # the default scale first
        values = ", ".join(f"{name} {SCALES[name].get(action.dest, field_defaults.get(action.dest))}" for name in order)
        base = action.help.rsplit(" (default: ", 1)[0]
        action.help = f"{base} (default: the scale's: {values})"


def check_options(args: argparse.Namespace) -> None:
    """Refuse bad bench options before any warning is printed or the results folder is made:
    the runner reads some of them only when a row starts (the budget, in each row's max-batch
    search), after the folder and its lock exist."""
    check_writable_dir(args.bench_out, "--out")  # empty, a file, or not writable: refused up front
    check_name_room(args.bench_out, OUT_FILES, "--out")  # a path too long for the report's files
    check_out_names(Path(args.bench_out))  # a link at results.jsonl, report.md, ...: refused up front
    if args.memory_budget is not None:
        parse_size(args.memory_budget)  # e.g. "lots": the one error: line, nothing written
    if args.multiple_of < 1:
        raise ConfigError(f"--multiple-of must be >= 1, got {args.multiple_of}")
    if args.nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {args.nproc}")


def run(args: argparse.Namespace) -> int:
    known = {f.name for s in ("data", "model", "train") for f in fields(SECTIONS[s])}
    overrides = {k: v for k, v in vars(args).items() if k in known}
    scale = resolve_scale(args)
    check_options(args)
    # Every row would refuse it, each in its own process: said once, before any row (or torch) starts.
    refuse_device_not_here(str(overrides.get("device") or "auto"))

    default_list = args.techniques is None
    if default_list:
        from memtrain.runtime.env import resolve_device  # torch: only once a bench really runs

        device_type = resolve_device(str(overrides.get("device") or "auto")).type
        techniques = default_techniques(device_type) + NOISE_ROWS
    else:
        techniques = args.techniques.split(",")
    opts = BenchOptions(
        techniques=[t.strip() for t in techniques if t.strip()],
        substitute_slow=default_list,
        scale=scale,
        out=Path(args.bench_out),
        overrides=overrides,
        file_layer=load_config_file(args.config) if args.config else {},
        force=args.force,
        maxbatch=not args.no_maxbatch,
        memory_budget=args.memory_budget,
        max_batch=args.max_batch,
        multiple_of=args.multiple_of,
        timeout_s=args.row_timeout,
        nproc=args.nproc,
        progress=overrides.get("progress"),
        command=shlex.join(["memtrain", *getattr(args, "_argv", ["bench"])]),
    )

    def on_row(name: str, row: dict) -> None:
        if row.get("skipped"):
            print(f"[{name}] already done (use --force to rerun)", file=sys.stderr)
        elif row.get("status") == "ok":
            mb = (row.get("max_batch") or {}).get("batch_size")
            searched = f", max batch {mb}" if mb is not None else ""  # --no-maxbatch, or a distributed row
            print(f"[{name}] ok: {ppl_words(row, row['val_ppl'])}, step {row['step_time_s']['median']:.3f} s, "
                  f"tracked peak {fmt_bytes(row['memory']['peak_bytes'])}{searched}", file=sys.stderr)
        else:
            print(f"[{name}] {row.get('status')}: {row.get('error')}", file=sys.stderr)

    # The report shows this bench's rows: those run (or found done) under its settings, never
    # a row of the same technique that an earlier bench ran otherwise.
    resolved = resolve_rows(opts)  # once: the settings and the bench use the same rows
    check_row_folders(opts.out, [name for name, _ in resolved])  # a link at rows/: before the folder exists
    for name, _ in resolved:  # each row's train checks its own folder, when it runs: too late for the rows after it
        check_folder_room(row_folder(opts.out, name), TRAIN_FILES, f"--out (row {name})")
    shared = bench_settings(opts, resolved)
    check_rows_data(resolved)  # empty or unreadable data: one error: line, no folder
    for data in sorted({cfg.data.data for _, cfg in resolved}):  # results.jsonl read by the next row
        check_out_outside_data(opts.out, data, OUT_FILES)
    settings = settings_hash(shared)
    try:
        # SIGTERM (`kill`, systemd, a job scheduler) arrives here as KeyboardInterrupt (cli.main).
        rows = run_bench(opts, on_row=on_row, rows=resolved, settings=shared)
    except KeyboardInterrupt:
        summary = write_report(opts.out, techniques=opts.techniques, settings=settings, replace_links=True)
        warn_skipped_lines(opts.out, summary)
        print(f"error: interrupted; partial report of {summary['rows']} row(s) in {opts.out}/report.md", file=sys.stderr)
        return 130
    summary = write_report(opts.out, techniques=opts.techniques, settings=settings, replace_links=True)
    print((opts.out / "report.md").read_text())
    print(f"wrote {one_line(str(opts.out))}/results.jsonl, report.md, report.csv, report.json and {len(summary['plots'])} plots")
    warn_skipped_lines(opts.out, summary)
    if summary["missing"]:
        print(f"error: partial report: no row for {', '.join(summary['missing'])}", file=sys.stderr)
        return 1
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


register("bench", "Compare techniques side by side: max batch, peak memory, step time, tokens/s, MFU, "
         "val perplexity; tables and plots.", add_args, run)
