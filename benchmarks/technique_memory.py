"""What each technique saves, measured: one steady-state training step of the default model
under the tracked memory meter, per technique, with the breakdown by category.

    python benchmarks/technique_memory.py --batch-size 4 --seq-len 128 \
        --out benchmarks/results/cpu-technique-memory/technique_memory.md

Each row is a real step (forward, backward, optimizer; the second of two, so optimizer state
exists) on random tokens (memory does not depend on token values). Dropout is 0 in every row
so the fused attention kernels can run on CPU. The table is what docs/techniques.md quotes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memtrain.analysis.maxbatch import measure_step_memory
from memtrain.bench.technique_sets import TECHNIQUES
from memtrain.config.argtypes import positive_int
from memtrain.config.run import ConfigError, build_config
from memtrain.files.results import benchmark_file_problem, write_text_atomic
from memtrain.runtime.env import environment, git_commit, resolve_device
from memtrain.techniques.facts import MEMORY_CATEGORIES

# (row name, overrides, what it shows)
ROWS: list[tuple[str, dict, str]] = [
    ("baseline fp32, math attention", {}, "reference"),
    ("bf16 autocast", {"precision": "bf16"}, "precision"),
    ("bf16-pure weights", {"precision": "bf16-pure"}, "precision"),
    ("sdpa attention", {"attention": "sdpa"}, "attention"),
    ("flash attention (SDPA)", {"attention": "flash"}, "attention"),
    ("window 32 (banded math)", {"window": 32}, "attention"),
    ("checkpointing every:2", {"checkpointing": "every:2"}, "checkpointing"),
    ("checkpointing selective", {"checkpointing": "selective"}, "checkpointing"),
    ("checkpointing full", {"checkpointing": "full"}, "checkpointing"),
    ("chunked loss", {"loss": "chunked"}, "loss"),
    ("chunked loss + checkpointing full", {"loss": "chunked", "checkpointing": "full"}, "combined"),
    ("adafactor", {"optim": "adafactor"}, "optimizer"),
    ("adamw-8bit (vocab padded to 50304)", {"optim": "adamw-8bit", "vocab_multiple": 64}, "optimizer"),
    ("adamw-4bit (vocab padded to 50304)", {"optim": "adamw-4bit", "vocab_multiple": 64}, "optimizer"),
    ("sgd (momentum)", {"optim": "sgd"}, "optimizer"),
    ("LoRA rank 8", {"lora_rank": 8}, "lora"),
    ("grad-accum 2 (half micro-batch)", {"grad_accum": 2, "_half_batch": True}, "accumulation"),
    # The bench's technique set itself, so this row measures what `memtrain bench` runs.
    ("lowest-memory preset", dict(TECHNIQUES["lowest-memory"]), "combined"),
]
CATS = MEMORY_CATEGORIES


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--batch-size", type=positive_int, default=4)
    ap.add_argument("--seq-len", type=positive_int, default=128)
    ap.add_argument("--out", type=Path, default=None,
                    help="Markdown file to write (default: print only); a new file, rewritten after every row")
    args = ap.parse_args(argv)
    problem = benchmark_file_problem(args.out) if args.out is not None else None
    if problem:
        ap.error(problem)
    # Every row's config first: one that cannot run at these sizes (a half batch of 1, a window
    # longer than the sequence) is refused before any row is measured.
    configs = []
    for name, overrides, _ in ROWS:
        o = {k: v for k, v in overrides.items() if not k.startswith("_")}
        batch = args.batch_size // 2 if overrides.get("_half_batch") else args.batch_size
        try:
            configs.append((name, batch, build_config({"device": "cpu", "dropout": 0.0, "seq_len": args.seq_len,
                                                       "batch_size": max(batch, 1)}, o)))
        except ConfigError as exc:
            ap.error(f"row {name!r} cannot run at --batch-size {args.batch_size} --seq-len {args.seq_len}: {exc}")
        if batch < 1:
            ap.error(f"row {name!r} halves the batch: give --batch-size 2 or more")
    mib = 2**20
    lines = [
        f"Command: `python benchmarks/technique_memory.py --batch-size {args.batch_size} --seq-len {args.seq_len}`  ",
        f"Commit: {git_commit()}; hardware: {environment(resolve_device('cpu'))['device']}; "
        f"torch {environment(resolve_device('cpu'))['torch']}.  ",
        f"Default model (16.2M parameters, vocab 50257), batch {args.batch_size} x seq {args.seq_len}, dropout 0; "
        "tracked meter, steady-state step; MiB at the peak.",
        "",
        "| technique | peak | vs baseline | parameters | gradients | optimizer | activations | temporaries | peak phase |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    base_peak = None
    for name, batch, cfg in configs:
        stats = measure_step_memory(cfg, batch)
        peak = stats["peak_bytes"]
        base_peak = base_peak or peak
        cats = " | ".join(f"{stats['by_category'][c] / mib:.1f}" for c in CATS)
        line = (f"| {name} | {peak / mib:.1f} | {(peak - base_peak) / base_peak * 100:+.1f}% | {cats} | "
                f"{stats['peak_phase']} |")
        lines.append(line)
        print(line, flush=True)
        if args.out:  # after every row: a later row's failure or a kill loses none before it
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.out, "\n".join(lines) + "\n")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
