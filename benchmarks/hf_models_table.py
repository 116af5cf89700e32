"""Full-size transformers models traced on CPU: memory by category per technique set.

For each bundled config (memtrain/models/configs) and each technique set, one steady-state
training step is traced under fake tensors (memtrain.analysis.trace.trace_step: nothing allocated,
the tracked peak exactly as a real step on the same kernels would meter it). Writes
``OUT/hf_models_table.json`` (one line per row, as each finishes) and ``OUT/hf_models_table.md``.

    python benchmarks/hf_models_table.py --out benchmarks/results/cpu-hf-models
    python benchmarks/hf_models_table.py --models llama-3-70b --sets qlora+ckpt+chunked --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from memtrain.analysis.trace import trace_step
    from memtrain.config import build_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = out / "hf_models_table.jsonl"
    done = set()
    if lines.exists():
        done = {(r["model"], r["set"]) for r in map(json.loads, lines.read_text().splitlines())}
    for model in args.models.split(","):
        for name in args.sets.split(","):
            if (model, name) in done:
                continue
            cfg = build_config({**BASE, **SETS[name], "model": model})
            start = time.perf_counter()
            r = trace_step(cfg, "cpu")
            row = {"model": model, "set": name, "flags": SETS[name], "peak_bytes": r["peak_bytes"],
                   "peak_phase": r["peak_phase"], "by_category": r["by_category"], "parameters": r["parameters"],
                   "trace_seconds": round(time.perf_counter() - start, 1)}
            with open(lines, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(model, name, f"{r['peak_bytes'] / GIB:.2f} GiB", f"{row['trace_seconds']} s", flush=True)
    write_markdown(out, lines)


def write_markdown(out: Path, lines: Path) -> None:
    rows = [json.loads(ln) for ln in lines.read_text().splitlines()]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    md = [f"Traced with `python benchmarks/hf_models_table.py --out {out}` at commit {commit} on "
          f"{platform.processor() or platform.machine()} (CPU kernels, torch {torch.__version__}); "
          f"batch 1 x seq 2048, bf16 weights, AdamW, SDPA. GiB at the step's peak.", "",
          "| model | techniques | peak | weights | gradients | optimizer | activations | temporaries | phase | trace s |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        c = r["by_category"]
        md.append(f"| {r['model']} | {r['set']} | {r['peak_bytes'] / GIB:.2f} | {c['parameters'] / GIB:.2f} | "
                  f"{c['gradients'] / GIB:.2f} | {c['optimizer'] / GIB:.2f} | {c['activations'] / GIB:.2f} | "
                  f"{c['temporaries'] / GIB:.2f} | {r['peak_phase']} | {r['trace_seconds']} |")
    (out / "hf_models_table.md").write_text("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
