"""`memtrain maxbatch`: the largest batch whose training step fits a device or a budget."""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from memtrain.analysis.fit import budget_for
from memtrain.cli import LOOP_ONLY_FIELDS, MODULE_TABLE_FIELDS, add_config_flags, config_from_args, fmt_bytes, register
from memtrain.config.argtypes import batch_count
from memtrain.config.run import ConfigError, parse_size


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", "--budget", dest="memory_budget", default=None,
                   help="Budget, e.g. 8GiB (required on CPU; on CUDA default: the device, or the --gpu card). "
                        "--budget: plan's name.")
    p.add_argument("--device-type", choices=("cpu", "cuda"), default=None,
                   help="cuda: measure on the CUDA device; without one, answer with the CUDA model (CUDA kernels' "
                        "memory rules, the caching allocator and the CUDA context, estimated: nothing runs). "
                        "Default: from --device.")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="The card the CUDA model assumes where no CUDA device is here (h100, a100-80gb, rtx4090, ...): "
                        "its memory is the budget unless --budget is given, its CUDA context is counted. "
                        "Implies --device-type cuda.")
    p.add_argument("--multiple-of", type=batch_count, default=1, help="Search batches in multiples of this (e.g. 8 for tensor cores).")
    p.add_argument("--max-batch", "--max", dest="max_search", type=batch_count, default=4096,
                   help="Upper bound of the search: largest batch to try (default 4096). Same flag in bench and plan.")
    p.add_argument("--method", choices=("auto", "measure", "trace"), default="auto",
                   help="measure: run real steps; trace: fake tensors, nothing allocated (default on CPU).")
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    add_config_flags(p, ("model", "technique", "train"), exclude=(*LOOP_ONLY_FIELDS, *MODULE_TABLE_FIELDS))


def run(args: argparse.Namespace) -> int:
    from memtrain.analysis.maxbatch import find_max_batch  # torch-free --help/estimate/plan

    cfg = config_from_args(args, derive_max_seq_len=True)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    if _wants_cuda_model(args, cfg):
        return _run_cuda_model(args, cfg, budget)
    if args.device_type == "cuda":
        cfg = cfg.replace(device="cuda")  # a CUDA device is here: measure on it, as --device cuda
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


def _wants_cuda_model(args: argparse.Namespace, cfg: Any) -> bool:
    """True when CUDA is asked for (--device-type cuda, --gpu) and no CUDA device is here to
    measure on: the answer is then the CUDA model's estimate."""
    if args.gpu is None and args.device_type != "cuda":
        return False
    if args.device_type == "cpu" or cfg.train.device == "cpu":
        raise ConfigError("--gpu names the card the CUDA model assumes: drop --device-type cpu/--device cpu, "
                          "or drop --gpu to search with CPU kernels")
    if args.method != "auto":
        raise ConfigError(f"--method {args.method} runs steps on a device; drop it next to --device-type cuda/--gpu "
                          "(measured on a CUDA device, estimated without one)")
    # torch loads only for a search that runs steps
    import torch

    return not torch.cuda.is_available()


def _run_cuda_model(args: argparse.Namespace, cfg: Any, budget: Optional[int]) -> int:
    """No CUDA device here: the largest batch by the CUDA model, said to be estimated."""
    # analysis.maxbatch imports torch: loaded only when this runs
    from memtrain.analysis.maxbatch import estimated_max_batch

    found = budget_for(budget, args.gpu)
    if found is None:
        raise ConfigError("no CUDA device here to measure on: name the card with --gpu NAME (h100, a100-80gb, "
                          "rtx4090, ...) or give --memory-budget SIZE, and the CUDA model estimates the max batch"
                          if args.gpu is None else
                          f"--gpu {args.gpu}: its memory is not in the GPU table; add --memory-budget SIZE")
    budget_bytes, source = found
    res = estimated_max_batch(cfg, budget_bytes, args.gpu, max_batch=args.max_search, multiple_of=args.multiple_of)
    out = res.to_dict()
    out["capped"] = all(p["fits"] for p in out["probes"])
    out["budget_source"] = source
    out["note"] = ("estimated, not measured: no CUDA device here; CUDA kernels' memory rules, the caching-allocator "
                   "model and the CUDA context (memtrain.analysis.allocator)")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    dm = res.device_memory or {}
    size = f"{res.batch_size}+" if out["capped"] else str(res.batch_size)
    print(f"max batch {size} (seq {cfg.train.seq_len}) fits {fmt_bytes(budget_bytes)} ({source}): "
          f"{fmt_bytes(res.peak_bytes)} on the device, ESTIMATED with the CUDA model, not measured")
    print(f"  reserved {fmt_bytes(dm.get('reserved'))} + CUDA context {fmt_bytes(dm.get('cuda_context'))} "
          f"(allocated {fmt_bytes(dm.get('allocated'))}); {len(res.probes)} estimates; run on a CUDA machine to measure")
    for line in dm.get("assumptions", []):
        print(f"  model: {line}")
    if out["capped"]:
        print(f"  {res.batch_size} is the search's upper bound, not the memory's: raise --max-batch to search further")
    return 0


register("maxbatch", "Find the largest batch whose training step fits a device or a memory budget.", add_args, run)
