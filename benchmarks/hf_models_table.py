"""Full-size transformers models traced on CPU: memory by category per technique set.

For each bundled config (memtrain/models/configs) and each technique set, one steady-state
training step is traced under fake tensors (nothing allocated, the tracked peak exactly as a
real step on the same kernels would meter it): by default two shallow copies of the model
(2 and 3 decoder layers) extended affinely to the real depth (memtrain.analysis.depth_trace), with
``--full-trace`` every layer (memtrain.analysis.trace.trace_step). Writes ``OUT/hf_models_table.jsonl``
(one line per row, as each finishes) and ``OUT/hf_models_table.md``; rows of ``OUT/full_traces.jsonl``
(an earlier ``--full-trace`` run) are shown beside the same rows.

    python benchmarks/hf_models_table.py --out benchmarks/results/cpu-hf-models
    python benchmarks/hf_models_table.py --models llama-3-70b --sets qlora+ckpt+chunked --out DIR
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from memtrain.config.argtypes import positive_int
from memtrain.files.results import append_jsonl, out_folder_problem, read_jsonl, write_text_atomic

# One step of batch 1 x seq 2048 in bf16 weights (bf16-pure: what single-GPU fine-tuning does),
# AdamW, SDPA attention; LoRA r16 on every decoder Linear (peft all-linear), QLoRA = the same
# adapters over NF4 base weights.
BASE = {"seq_len": 2048, "batch_size": 1, "precision": "bf16-pure", "attention": "sdpa", "optim": "adamw",
        "device": "cpu"}
SETS: dict[str, dict] = {
    "full": {},
    "full+ckpt": {"checkpointing": "full"},
    "full+ckpt+chunked": {"checkpointing": "full", "loss": "chunked"},
    "lora": {"lora_rank": 16},
    "lora+ckpt": {"lora_rank": 16, "checkpointing": "full"},
    "lora+chunked": {"lora_rank": 16, "loss": "chunked"},
    "lora+ckpt+chunked": {"lora_rank": 16, "checkpointing": "full", "loss": "chunked"},
    "qlora": {"lora_rank": 16, "qlora": True},
    "qlora+ckpt": {"lora_rank": 16, "qlora": True, "checkpointing": "full"},
    "qlora+ckpt+chunked": {"lora_rank": 16, "qlora": True, "checkpointing": "full", "loss": "chunked"},
}
MODELS = ["llama-3-8b", "qwen2.5-7b", "mistral-7b", "llama-3-70b"]
GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated bundled configs or model specs")
    ap.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of: {', '.join(SETS)}")
    ap.add_argument("--out", required=True, help="folder of the table; rows already in it are kept and skipped")
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--full-trace", action="store_true", help="trace every layer (minutes per row)")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    sets = [n for n in args.sets.split(",") if n]
    unknown = [n for n in sets if n not in SETS]
    if unknown or not sets or not models:
        ap.error(f"--sets: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SETS)}"
                 if unknown or not sets else "--models: name at least one")
    out = Path(args.out)
    # a link or a file as --out, or a link under a name written there: refused before any row
    problem = out_folder_problem(out, ("hf_models_table.jsonl", "full_traces.jsonl", "hf_models_table.md"))
    if problem:
        ap.error(problem)
    torch.set_num_threads(args.threads)
    from memtrain.analysis.depth_trace import trace_any_depth  # torch-heavy: after the arguments are checked
    from memtrain.config.run import build_config

    out.mkdir(parents=True, exist_ok=True)
    lines = out / ("full_traces.jsonl" if args.full_trace else "hf_models_table.jsonl")
    # A line torn by a kill mid-append is skipped (and re-traced), not a reason to stop.
    done = {(r.get("model"), r.get("set")) for r in read_jsonl(lines).rows}
    for model in models:
        for name in sets:
            if (model, name) in done:
                continue
            cfg = build_config({**BASE, **SETS[name], "model": model})
            start, cpu = time.perf_counter(), time.process_time()
            r = trace_any_depth(cfg, "cpu", full=args.full_trace)
            row = {"model": model, "set": name, "flags": SETS[name], "method": r["method"],
                   "probe_layers": r["probe_layers"], "peak_bytes": r["peak_bytes"],
                   "peak_phase": r["peak_phase"], "by_category": r["by_category"], "parameters": r["parameters"],
                   "trace_seconds": round(time.perf_counter() - start, 1),
                   # CPU seconds of this process: what the row costs, whatever the machine's load
                   "trace_cpu_seconds": round(time.process_time() - cpu, 1)}
            append_jsonl(lines, row)
            print(model, name, f"{r['peak_bytes'] / GIB:.2f} GiB", f"{row['trace_seconds']} s", flush=True)
    if not args.full_trace:
        write_markdown(out, lines)
    return 0


def write_markdown(out: Path, lines: Path) -> None:
    rows = read_jsonl(lines).rows
    full = {(r.get("model"), r.get("set")): r for r in read_jsonl(out / "full_traces.jsonl").rows}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    md = [f"Traced with `python benchmarks/hf_models_table.py --out {out}` at commit {commit} on "
          f"{platform.processor() or platform.machine()} (CPU kernels, torch {torch.__version__}); "
          f"batch 1 x seq 2048, bf16 weights, AdamW, SDPA. GiB at the step's peak. 'trace s': wall time of "
          f"this row ('method' extrapolated: 2 + 3 layers traced); 'full trace': the peak of the same step "
          f"with every layer traced (full_traces.jsonl) and its wall time.", "",
          "| model | techniques | peak | weights | gradients | optimizer | activations | temporaries | phase "
          "| method | trace s | full trace | full s |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        c = r["by_category"]
        md.append(f"| {r['model']} | {r['set']} | {r['peak_bytes'] / GIB:.2f} | {c['parameters'] / GIB:.2f} | "
                  f"{c['gradients'] / GIB:.2f} | {c['optimizer'] / GIB:.2f} | {c['activations'] / GIB:.2f} | "
                  f"{c['temporaries'] / GIB:.2f} | {r['peak_phase']} | {r.get('method', 'trace')} | "
                  f"{r['trace_seconds']} | {_full(full.get((r['model'], r['set'])), r)} |")
    write_text_atomic(out / "hf_models_table.md", "\n".join(md) + "\n")


def _full(f: dict | None, r: dict) -> str:
    """The full trace's peak (bytes equal, or the difference) and seconds, or blanks."""
    if f is None:
        return " | "
    same = "same bytes" if f["peak_bytes"] == r["peak_bytes"] else f"{(r['peak_bytes'] - f['peak_bytes']) / GIB:+.4f} GiB"
    return f"{f['peak_bytes'] / GIB:.2f} ({same}) | {f['trace_seconds']}"


if __name__ == "__main__":
    sys.exit(main())
