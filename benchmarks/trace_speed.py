"""How long each row of the full-size table (benchmarks/hf_models_table.py) takes to trace, and
whether its bytes are still the recorded ones.

Every row is traced in one process after one untimed warm-up row (so imports and one-time
set-up are not charged to the first row), timed in wall seconds and in CPU seconds of this
process (the machine is shared: CPU seconds are what the row costs, wall seconds what it took
under the load of the moment). Each row's peak and categories are compared with the recorded
row of ``--recorded`` (bytes must not change when only the speed of tracing does). Appends
to ``OUT/trace_speed.jsonl`` (``--label`` tells runs apart: ``before`` for the code before a
change, run with PYTHONPATH pointing at its source tree, and ``--commit`` naming it) and writes
``OUT/trace_speed.md``.

    python benchmarks/trace_speed.py --label after --out benchmarks/results/cpu-hf-models
    PYTHONPATH=/tmp/old/src python benchmarks/trace_speed.py --label before --commit OLD_COMMIT \\
        --rows llama-3-8b:full,llama-3-70b:qlora --out benchmarks/results/cpu-hf-models
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_models_table import BASE, MODELS, SETS  # noqa: E402
from memtrain.config.argtypes import positive_int  # noqa: E402
from memtrain.devices.probe import cpu_model  # noqa: E402
from memtrain.files.results import append_jsonl, out_folder_problem, read_jsonl, write_text_atomic  # noqa: E402

GIB = 2**30



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--rows", default="", help="model:set,... instead of every --models x --sets pair")
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", required=True, help="before / after: which code traced")
    ap.add_argument("--commit", default="", help="commit of the traced code (default: this checkout's HEAD)")
    ap.add_argument("--recorded", default="benchmarks/results/cpu-hf-models/hf_models_table.jsonl")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--reps", type=positive_int, default=1, help="trace each row this many times; the fastest counts")
    args = ap.parse_args(argv)
    rows = [(m, s) for m in args.models.split(",") if m for s in args.sets.split(",") if s]
    if args.rows:
        pairs = [r.split(":") for r in args.rows.split(",") if r]
        if any(len(pr) != 2 for pr in pairs):
            ap.error("--rows: give model:set pairs, comma-separated")
        rows = [(pr[0], pr[1]) for pr in pairs]
    unknown = sorted({name for _, name in rows if name not in SETS})
    if unknown or not rows:
        ap.error(f"unknown technique sets {', '.join(unknown) or '(none given)'}; choose from {', '.join(SETS)}")
    out = Path(args.out)
    # a link or a file as --out, or a link under a name written there: refused before any row
    problem = out_folder_problem(out, ("trace_speed.jsonl", "trace_speed.md"))
    if problem:
        ap.error(problem)
    torch.set_num_threads(args.threads)
    from memtrain.analysis.depth_trace import trace_any_depth  # torch-heavy: after the arguments are checked
    from memtrain.config.run import build_config

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    recorded = {(r.get("model"), r.get("set")): r for r in read_jsonl(Path(args.recorded)).rows}
    out.mkdir(parents=True, exist_ok=True)
    meta = {"label": args.label, "commit": commit, "cpu": cpu_model(), "torch": torch.__version__,
            "threads": args.threads, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    start = time.perf_counter()
    trace_any_depth(build_config({**BASE, **SETS[rows[0][1]], "model": rows[0][0]}), "cpu")  # warm-up
    meta["warmup_s"] = round(time.perf_counter() - start, 1)
    for model, name in rows:
        cfg = build_config({**BASE, **SETS[name], "model": model})
        walls, cpus = [], []
        for _ in range(args.reps):
            wall, cpu = time.perf_counter(), time.process_time()
            r = trace_any_depth(cfg, "cpu")
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        wall, cpu = min(walls), min(cpus)
        old = recorded.get((model, name))
        same = None if old is None else (old["peak_bytes"] == r["peak_bytes"] and old["by_category"] == r["by_category"]
                                         and old["parameters"] == r["parameters"])
        row = {**meta, "model": model, "set": name, "method": r["method"], "peak_bytes": r["peak_bytes"],
               "by_category": r["by_category"], "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "reps": args.reps,
               "same_bytes_as_recorded": same}
        append_jsonl(out / "trace_speed.jsonl", row)  # runs accumulate: each label's fastest counts
        print(args.label, model, name, f"{r['peak_bytes'] / GIB:.2f} GiB", f"{row['wall_s']} s wall",
              f"{row['cpu_s']} s cpu", "same bytes" if same else f"BYTES DIFFER ({same})", flush=True)
    write_markdown(out, recorded)
    return 0


def write_markdown(out: Path, recorded: dict) -> None:
    """One row per (model, techniques): the recorded table's seconds, then the fastest of all
    runs of each label (wall and CPU seconds, each its own minimum: runs alternate between the
    labels, so both meet the same loads) and whether the bytes equal the recorded ones."""
    runs = read_jsonl(out / "trace_speed.jsonl").rows  # a line torn by a kill is skipped
    latest: dict[tuple[str, str, str], dict] = {}
    for r in runs:
        k = (r["label"], r["model"], r["set"])
        if k in latest:
            prev = latest[k]
            r = {**r, "wall_s": min(r["wall_s"], prev["wall_s"]), "cpu_s": min(r["cpu_s"], prev["cpu_s"]),
                 "same_bytes_as_recorded": r["same_bytes_as_recorded"] and prev["same_bytes_as_recorded"],
                 "runs": prev.get("runs", 1) + 1}
        latest[k] = r
    order = {(m, s): i for i, (m, s) in enumerate((m, s) for m in MODELS for s in SETS)}
    keys = sorted(dict.fromkeys((r["model"], r["set"]) for r in runs), key=lambda k: order.get(k, len(order)))
    heads = {}
    for label in ("before", "after"):
        one = next((r for r in reversed(runs) if r["label"] == label), None)
        if one is not None:
            heads[label] = one
    md = ["Seconds to trace one row of `hf_models_table.md` (two probes of 2 and 3 decoder layers, two steps "
          "each, extrapolated to the real depth), in a process that traced one untimed warm-up row first "
          "(imports; a cold `memtrain estimate --trace` adds them). Wall seconds on a machine shared with "
          "other jobs, and the process's CPU seconds; each the fastest of every run of that label (runs of "
          "the two labels alternate, so both meet the same loads; 'runs' counts them). 'recorded': the "
          "`trace s` of hf_models_table.md (one process for all rows, under another load). 'bytes': the "
          "traced peak and every category equal to hf_models_table.jsonl in every run.", ""]
    for label, r in heads.items():
        md.append(f"- {label}: `python benchmarks/trace_speed.py --label {label} ...` at commit {r['commit']} "
                  f"(last run {r['date']}), {r['cpu']}, torch {r['torch']}, {r['threads']} thread(s)")
    md += ["", "| model | techniques | recorded s | before wall s | before CPU s | runs | after wall s | after CPU s "
           "| runs | bytes |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for model, name in keys:
        b, a = latest.get(("before", model, name)), latest.get(("after", model, name))
        rec = recorded.get((model, name), {}).get("trace_seconds", "")
        sames = [x["same_bytes_as_recorded"] for x in (b, a) if x is not None]
        same = "same" if sames and all(sames) else "DIFFER" if sames else ""
        md.append(f"| {model} | {name} | {rec} | {_cells(b)} | {_cells(a)} | {same} |")
    write_text_atomic(out / "trace_speed.md", "\n".join(md) + "\n")


def _cells(r: dict | None) -> str:
    if r is None:
        return " | | "
    return f"{r['wall_s']} | {r['cpu_s']} | {r.get('runs', 1)}"


if __name__ == "__main__":
    sys.exit(main())
