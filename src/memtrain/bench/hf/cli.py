"""``python benchmarks/compare_hf.py`` (or ``python -m memtrain.bench.hf``): flags, the rows they
name, and the loop over rows x repetitions (each side in its own process)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from memtrain.bench.hf.lockstep import run_pair, run_subprocess
from memtrain.bench.hf.report import mib, num, write_profiles, write_report
from memtrain.bench.hf.rows import (
    COMMANDS_FILE,
    REPORT_JSON,
    REPORT_MD,
    RUNS_FILE,
    SIDES,
    append_run,
    config_hash,
    read_runs,
    read_runs_counted,
    resolve_rows,
)
from memtrain.bench.scales import SCALE_BUDGET, SCALE_MAX_BATCH, SCALES
from memtrain.bench.technique_sets import TECHNIQUES
from memtrain.config.run import ConfigError, parse_size
from memtrain.files.lock import FolderLock
from memtrain.files.results import open_append, out_folder_problem, write_all
from memtrain.runtime.signals import sigterm_as_interrupt

DESCRIPTION = "memtrain vs Hugging Face Trainer: the same model, tokens and schedule, the same meters."


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION, allow_abbrev=False)
    ap.add_argument("--scale", default="quick", choices=sorted(SCALES),
                    help="memtrain bench scale (model, batch, seq, steps); `memtrain bench --scale` names the same")
    ap.add_argument("--techniques", "--presets", dest="techniques", default=",".join(TECHNIQUES),
                    help="comma-separated rows, as `memtrain bench --techniques`: technique sets "
                         f"({', '.join(TECHNIQUES)}) or key=value+key=value; --presets is the former name")
    ap.add_argument("--model", default=None, metavar="SPEC",
                    help="a transformers model for both sides (memtrain's --model SPEC: a bundled config such as "
                         "tiny-llama or tiny-gpt2, a config.json, or a directory); default: memtrain's GPT against "
                         "GPT2LMHeadModel")
    ap.add_argument("--out", default="runs/compare-hf",
                    help="folder for runs.jsonl, compare_hf.json, compare_hf.md (default runs/compare-hf); one that "
                         "holds an earlier comparison is refused unless --resume or --report-only")
    ap.add_argument("--budget", default=None, help="memory budget of the max-batch search (default: the scale's on CPU)")
    ap.add_argument("--max-batch", type=int, default=None, help="largest batch the search tries")
    ap.add_argument("--no-maxbatch", action="store_true", help="skip the max-batch search")
    ap.add_argument("--maxbatch-method", default="auto", choices=("auto", "trace", "measure"),
                    help="probe steps under fake tensors (trace: fast, exact for eager steps; CPU default) or run "
                         "them (measure: needed for compiled steps such as torchao's low-bit optimizers; CUDA default)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the scale's)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="learning-rate warm-up steps (default: the scale's)")
    ap.add_argument("--repeats", type=int, default=1, help="repetitions of every preset (timing noise)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads in each run (default: torch's)")
    ap.add_argument("--device", default="auto", help="auto|cpu|cuda")
    ap.add_argument("--timeout", type=float, default=None, help="seconds one run may take")
    ap.add_argument("--lockstep", action=argparse.BooleanOptionalAction, default=True,
                    help="run both sides of a preset at once, taking turns step by step (default); "
                         "--no-lockstep runs them one after the other")
    ap.add_argument("--exact-schedule", action="store_true",
                    help="give the Trainer memtrain's learning-rate schedule (a check of the PPL gap; "
                         "default: HF's cosine_with_min_lr)")
    ap.add_argument("--profile", type=int, default=None, metavar="STEPS",
                    help="instead of the comparison: per-phase times of both steps over STEPS alternating steps "
                         "in one process, and their top operators (OUT/profile.md)")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild compare_hf.json/.md from OUT/runs.jsonl without running anything")
    ap.add_argument("--resume", action="store_true", help="keep runs already in OUT/runs.jsonl with the same config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="any other memtrain config field for every row, e.g. --set d_model=64 (repeatable)")
    return ap.parse_args(argv)


def resolve(opts: argparse.Namespace) -> tuple[list[dict[str, Any]], Optional[dict[str, Any]], Optional[str]]:
    """The rows, the max-batch settings and the budget the flags name (ConfigError when bad)."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import resolve_device

    device = resolve_device(opts.device)
    overrides: dict[str, Any] = {"progress": False, "device": opts.device}
    if opts.steps is not None:
        overrides["steps"] = opts.steps
    if opts.warmup_steps is not None:
        overrides["warmup_steps"] = opts.warmup_steps
    if opts.model is not None:
        overrides["model"] = opts.model
    for item in opts.set:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"cannot read --set {item!r}; write KEY=VALUE, e.g. --set d_model=64")
        overrides[key.strip().replace("-", "_")] = value.strip()
    techniques = [p.strip() for p in opts.techniques.split(",") if p.strip()]
    rows = resolve_rows(opts.scale, techniques, overrides, device.type)
    if not opts.exact_schedule:
        _refuse_unmatched_schedule(rows)
    budget = opts.budget or (SCALE_BUDGET.get(opts.scale) if device.type == "cpu" else None)
    if device.type == "cpu" and budget is None:
        budget = "1GiB"
    maxbatch = None if opts.no_maxbatch else {
        "budget_bytes": parse_size(budget) if budget else None,
        "max_batch": opts.max_batch or SCALE_MAX_BATCH.get(opts.scale, 1024),
        "method": opts.maxbatch_method if opts.maxbatch_method != "auto" else (
            "measure" if device.type == "cuda" else "trace"),
    }
    if opts.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {opts.repeats}")
    return rows, maxbatch, budget


def _refuse_unmatched_schedule(rows: list[dict[str, Any]]) -> None:
    """The Trainer's ``linear`` decays to 0 and has no floor: a memtrain linear schedule floored at
    --min-lr-ratio above 0 has no Trainer twin, so the two sides would train at different rates."""
    for row in rows:
        t = row["config"].train
        if t.schedule == "linear" and t.min_lr_ratio != 0:
            raise ConfigError(f"schedule linear with min_lr_ratio {t.min_lr_ratio:g}: the Trainer's linear schedule "
                              "decays to 0; add --set min_lr_ratio=0, or --exact-schedule to give the Trainer "
                              "memtrain's schedule")


def settings_of(opts: argparse.Namespace, rows: list[dict[str, Any]], maxbatch: Optional[dict[str, Any]],
                budget: Optional[str]) -> dict[str, Any]:
    """What the report's header says about the run (the same keys for every model)."""
    t0 = rows[0]["config"].train
    return {
        "scale": opts.scale, "batch_size": t0.batch_size, "seq_len": t0.seq_len, "steps": t0.steps,
        "warmup_steps": t0.warmup_steps, "grad_accum": t0.grad_accum, "dropout": rows[0]["config"].model.dropout,
        "repeats": opts.repeats, "budget": budget, "max_batch": (maxbatch or {}).get("max_batch"),
        "maxbatch_method": None if maxbatch is None else maxbatch["method"],
        "threads": opts.threads, "device": opts.device, "lockstep": opts.lockstep,
        "exact_schedule": opts.exact_schedule, "model": opts.model,
    }


def run_rows(opts: argparse.Namespace, out: Path, rows: list[dict[str, Any]], maxbatch: Optional[dict[str, Any]],
             settings: dict[str, Any], command: str, start: float) -> None:
    """Every row x repetition not yet recorded: both sides (in lockstep by default), one line
    of ``runs.jsonl`` per side as it finishes, the report rewritten after each row."""
    done = {(r["preset"], r["side"], r["rep"], r["config_hash"]) for r in read_runs(out)
            if r["result"].get("status") == "ok"}
    for rep in range(opts.repeats):
        for i, row in enumerate(rows):
            name, cfg, plan = row["preset"], row["config"], row["plan"]
            if plan.status == "none":
                if rep == 0:
                    print(f"[{name}] no HF equivalent: {'; '.join(plan.missing)}", flush=True)
                continue
            order = SIDES if (rep + i) % 2 == 0 else SIDES[::-1]
            h = config_hash(cfg)
            todo = [side for side in order if (name, side, rep, h) not in done]
            if not todo:
                continue
            mb = maxbatch if rep == 0 else None
            lockstep = bool(opts.lockstep and len(todo) == 2)
            if lockstep:
                results = run_pair(order, cfg, mb, opts.threads, opts.timeout, opts.exact_schedule)
            else:
                results = {side: run_subprocess(side, cfg, mb, opts.threads, opts.timeout, opts.exact_schedule)
                           for side in todo}
            for side in todo:
                result = results[side]
                append_run(out, name, side, rep, order.index(side) + 1, lockstep, h, result)
                st = (result.get("step_time_s") or {}).get("median")
                peak = (result.get("memory") or {}).get("peak_bytes")
                print(f"[rep {rep} {name} {side}] {result.get('status')}: step {num(st)} s, peak {mib(peak)} MiB, "
                      f"val ppl {num(result.get('val_ppl'), '{:,.1f}')}, max batch "
                      f"{(result.get('max_batch') or {}).get('batch_size')}, {result.get('process_wall_s', 0):.0f} s"
                      + (f" ({result.get('error')})" if result.get("status") != "ok" else ""), flush=True)
            write_report(out, rows, settings, command, start)


def out_problem(out: Path, opts: argparse.Namespace) -> Optional[str]:
    """Why ``--out`` cannot take this command, or None: a link or a file where the folder goes;
    an earlier comparison's runs.jsonl without ``--resume`` (or ``--report-only``), which a new one
    would mix with or replace; an earlier profile.md under ``--profile``."""
    problem = out_folder_problem(out, (RUNS_FILE, COMMANDS_FILE, REPORT_JSON, REPORT_MD, "profile.md"))
    if problem:
        return problem
    if opts.profile is not None and os.path.lexists(out / "profile.md"):
        return f"--out {out} already holds profile.md from an earlier run; name another folder or move it away"
    if opts.profile is None and not (opts.resume or opts.report_only) and os.path.lexists(out / RUNS_FILE):
        return (f"--out {out} already holds {RUNS_FILE} of an earlier comparison; name a new folder, continue it "
                "with --resume, or re-write its report with --report-only")
    return None


def report_only_problem(out: Path) -> Optional[str]:
    """Why ``--report-only`` cannot rebuild a report from ``out`` (None when it can): no
    runs.jsonl, or one holding no run (another tool's file, or every line torn), whose report of
    rows all "not run", stamped with this machine and now, looked like a finished comparison."""
    if not (out / RUNS_FILE).is_file():
        return f"{out / RUNS_FILE} not found; run the comparison first"
    read = read_runs_counted(out)
    if not read.rows:
        return (f"{out / RUNS_FILE} holds no run ({read.skipped} unreadable line(s) skipped); give the folder of a "
                "comparison, or run the comparison first")
    return None


# The command the reports name (commands.log, compare_hf.md) when the caller does not say.
DEFAULT_PROG = "python benchmarks/compare_hf.py"


def main(argv: list[str], prog: str = DEFAULT_PROG) -> int:
    """Run the comparison the flags ``argv`` name; ``prog`` is how the reports write the command."""
    if argv[:1] == ["--worker"]:
        # on this side's turn: the package imports no torch before the lockstep baton
        from memtrain.bench.hf.worker import worker_main

        return worker_main(*argv[1:4])
    opts = parse_args(argv)
    start = time.perf_counter()
    command = f"{prog} " + " ".join(argv)
    try:
        rows, maxbatch, budget = resolve(opts)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    settings = settings_of(opts, rows, maxbatch, budget)
    out = Path(opts.out)
    problem = out_problem(out, opts)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    problem = report_only_problem(out) if opts.report_only else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    # One comparison per folder at a time: two `--resume` runs on one folder both ran the rows
    # neither had recorded and appended each twice. The lock is taken before runs.jsonl is read.
    try:
        with FolderLock(out, "compare_hf"), sigterm_as_interrupt():
            return run_in_folder(opts, out, rows, maxbatch, settings, command, start)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def run_in_folder(opts: argparse.Namespace, out: Path, rows: list[dict[str, Any]], maxbatch: Optional[dict[str, Any]],
                  settings: dict[str, Any], command: str, start: float) -> int:
    """The comparison in ``out``, whose lock this process holds: the runs not yet recorded, then
    the report (or only the report, or the profiles); the exit code."""
    skipped = read_runs_counted(out).skipped if (out / RUNS_FILE).is_file() else 0
    if skipped:  # said once; the report and --resume read only the runs
        print(f"warning: skipped {skipped} unreadable line(s) of {out / RUNS_FILE} (torn by a kill or a full disk, "
              "or not shaped like a run)", file=sys.stderr)
    if opts.profile is not None:
        return write_profiles(out, rows, opts.profile, command)
    if opts.report_only:
        write_report(out, rows, settings, None, start)  # None: keep the commands that produced the runs
        print((out / REPORT_MD).read_text().split("## Memory at the peak")[0])
        return 0
    fd = open_append(out / COMMANDS_FILE)
    try:
        write_all(fd, f"{command}  # started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), out / COMMANDS_FILE)
    finally:
        os.close(fd)
    try:
        run_rows(opts, out, rows, maxbatch, settings, command, start)
    except KeyboardInterrupt:  # every finished run is already a line of runs.jsonl
        write_report(out, rows, settings, command, start)
        print(f"interrupted: the runs that finished are in {out / RUNS_FILE}; continue with --resume", file=sys.stderr)
        return 130
    report = write_report(out, rows, settings, command, start)
    print((out / REPORT_MD).read_text().split("## Memory at the peak")[0])
    return 0 if all(e["sides"].get(s, {}).get("status") in ("ok", None)
                    for e in report["rows"] if e["hf_status"] != "none" for s in SIDES) else 1
