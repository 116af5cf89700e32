"""`memtrain maxbatch`: the largest batch whose training step fits a device or a budget."""

from __future__ import annotations

import argparse
import json

from memtrain.argtypes import batch_count
from memtrain.cli import LOOP_ONLY_FIELDS, add_config_flags, config_from_args, fmt_bytes, register
from memtrain.config import parse_size


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", "--budget", dest="memory_budget", default=None,
                   help="Budget, e.g. 8GiB (required on CPU; on CUDA default: the device). --budget: plan's name.")
    p.add_argument("--multiple-of", type=batch_count, default=1, help="Search batches in multiples of this (e.g. 8 for tensor cores).")
    p.add_argument("--max-batch", "--max", dest="max_search", type=batch_count, default=4096,
                   help="Upper bound of the search: largest batch to try (default 4096). Same flag in bench and plan.")
    p.add_argument("--method", choices=("auto", "measure", "trace"), default="auto",
                   help="measure: run real steps; trace: fake tensors, nothing allocated (default on CPU).")
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    add_config_flags(p, ("model", "technique", "train"), exclude=LOOP_ONLY_FIELDS)


def run(args: argparse.Namespace) -> int:
    from memtrain.analysis.maxbatch import find_max_batch  # torch-free --help/estimate/plan

    cfg = config_from_args(args, derive_max_seq_len=True)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    res = find_max_batch(cfg, budget_bytes=budget, max_batch=args.max_search, multiple_of=args.multiple_of,
                         progress=not args.json, method=args.method)
    out = res.to_dict()
    # Every probe fitted: the search's upper bound stopped it, so the batch is a lower bound.
    out["capped"] = all(p["fits"] for p in out["probes"])
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        budget_text = fmt_bytes(res.budget_bytes) if res.budget_bytes else "the device memory"
        size = f"{res.batch_size}+" if out["capped"] else str(res.batch_size)
        print(f"max batch {size} (seq {cfg.train.seq_len}) fits {budget_text}: "
              f"peak {fmt_bytes(res.peak_bytes)} ({res.method}, {len(res.probes)} probes on {res.device})")
        if out["capped"]:
            print(f"  {res.batch_size} is the search's upper bound, not the memory's: raise --max-batch to search further")
    return 0


register("maxbatch", "Find the largest batch whose training step fits a device or a memory budget.", add_args, run)
