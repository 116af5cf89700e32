"""What torch.compile's activation memory budget saves: one steady-state step of the default
model (chunked loss, so the logits do not drown the blocks) at each budget, traced under fake
tensors through inductor's decompositions and partitioner (memtrain.analysis.trace), beside the
eager step with and without full checkpointing.

    python benchmarks/compile_budget_memory.py --batch-size 4 --seq-len 128 \
        --out benchmarks/results/cpu-compile-budget/compile_budget_memory.md

The traced bytes are the tracked meter's bytes of the real compiled step
(tests/test_compile_budget.py holds them equal by category on a tiny model). No time is
measured here: on CPU inductor's compile takes minutes, and a budget's recompute cost is a GPU
question.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Optional

from memtrain.analysis.trace import trace_step
from memtrain.config.argtypes import positive_int
from memtrain.config.run import ConfigError, build_config
from memtrain.files.results import benchmark_file_problem, write_text_atomic
from memtrain.runtime.env import git_commit

MIB = 2**20


def _row(name: str, overrides: dict[str, Any], base: dict[str, Any]) -> list[str]:
    start = time.perf_counter()
    r = trace_step(build_config({**base, **overrides}))
    saved: Optional[dict[str, Any]] = r.get("compile")
    return [name, f"{r['peak_bytes'] / MIB:.1f}", f"{r['category_peaks']['activations'] / MIB:.1f}",
            f"{saved['saved_activation_bytes'] / MIB:.1f}" if saved else "-", f"{time.perf_counter() - start:.0f}"]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--batch-size", type=positive_int, default=4)
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--scope", choices=("model", "block"), default="model")
    p.add_argument("--out", type=Path, default=None,
                   help="Also write the table (Markdown) here: a new file, rewritten after every row.")
    args = p.parse_args(argv)
    problem = benchmark_file_problem(args.out) if args.out is not None else None
    if problem:
        p.error(problem)
    base = {"batch_size": args.batch_size, "seq_len": args.seq_len, "dropout": 0.0, "loss": "chunked",
            "device": "cpu"}
    steps = [("eager, no checkpointing", {}), ("eager, checkpointing full", {"checkpointing": "full"})]
    steps += [(f"compile ({args.scope} scope), budget {budget:g}",
               {"compile": True, "compile_scope": args.scope, "compile_memory_budget": budget})
              for budget in (1.0, 0.75, 0.5, 0.25, 0.1)]
    try:
        for _, overrides in steps:  # every row's config before the first (minutes-long) trace
            build_config({**base, **overrides})
    except ConfigError as exc:
        p.error(str(exc))
    head = ["step", "peak MiB", "activations MiB (category peak)", "saved by the partition MiB", "trace s"]
    lines = [f"Default model, batch {args.batch_size} x seq {args.seq_len}, fp32, chunked loss, dropout 0; "
             f"traced on CPU kernels at commit {git_commit()}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for name, overrides in steps:
        lines.append("| " + " | ".join(_row(name, overrides, base)) + " |")
        print(lines[-1], flush=True)
        if args.out:  # after every row: a later failure or a kill loses none before it
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(args.out, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
