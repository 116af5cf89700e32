"""`memtrain maxbatch`: the largest batch whose training step fits a device or a budget."""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from memtrain.analysis.fit import (
    DEFAULT_LENGTH_MULTIPLE,
    budget_for,
    check_batch_bounds,
    longer_fits_mark,
    require_search_budget,
)
from memtrain.cli import (
    LOOP_ONLY_FIELDS,
    MODULE_TABLE_FIELDS,
    add_config_flags,
    add_loss_on_flag,
    add_packing_flag,
    config_from_args,
    defaults_note,
    fmt_bytes,
    refuse_device_not_here,
    register,
)
from memtrain.commands.estimate import add_device_type_flag, add_gpu_flag, add_max_len_flag, refuse_gpu_off_cuda
from memtrain.config.argtypes import batch_count
from memtrain.config.run import ConfigError, parse_size


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", "--budget", dest="memory_budget", default=None, metavar="SIZE",
                   help="Budget, e.g. 8GiB (required on CPU; on CUDA default: the device, or the --gpu card). "
                        "--budget: plan's name.")
    add_device_type_flag(p, "cuda: measure on the CUDA device; without one, answer with the CUDA model (CUDA kernels' "
                            "memory rules, the caching allocator and the CUDA context, estimated: nothing runs). "
                            "Default: from --device.")
    add_gpu_flag(p, "The card the CUDA model assumes where no CUDA device is here (h100, a100-80gb, rtx4090, ...): "
                    "its memory is the budget unless --budget is given, its CUDA context is counted. "
                    "Implies --device-type cuda.")
    p.add_argument("--search", choices=("batch", "seq-len"), default="batch",
                   help="batch: the largest batch at --seq-len (default); seq-len: the longest sequence length at "
                        "--batch-size (default 1), the longest context that fits.")
    p.add_argument("--multiple-of", type=batch_count, default=None,
                   help="Search in multiples of this: batches (default 1; e.g. 8 for tensor cores), or with "
                        f"--search seq-len lengths (default {DEFAULT_LENGTH_MULTIPLE}, or the --window).")
    p.add_argument("--max-batch", "--max", dest="max_search", type=batch_count, default=None,
                   help="Upper bound of the search: largest batch to try (default 4096). Same flag in bench and plan.")
    add_max_len_flag(p, "--search seq-len")
    p.add_argument("--method", choices=("auto", "measure", "trace"), default="auto",
                   help="measure: run real steps; trace: fake tensors, nothing allocated; auto (the default): "
                        "measure on CUDA, trace elsewhere.")
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    add_config_flags(p, ("model", "technique", "train"), exclude=(*LOOP_ONLY_FIELDS, *MODULE_TABLE_FIELDS))
    add_loss_on_flag(p)  # --loss-on completion: the answers-only step, sized without data
    add_packing_flag(p)  # --packing pad: the same batch x seq_len step, taken so a train command's flags fit


def run(args: argparse.Namespace) -> int:
    _check_search_flags(args)
    # The length search sets each probe's --seq-len; the config's own starts at the shortest valid
    # one, so that a short --max-seq-len or a --window is not measured against the default length.
    base = {"seq_len": getattr(args, "window", None) or 1} if args.search == "seq-len" else None
    cfg = config_from_args(args, base=base, derive_max_seq_len=True)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    _refuse_before_the_search(args, cfg, budget)
    rc = _run_seq_len(args, cfg, budget) if args.search == "seq-len" else _run_batch(args, cfg, budget)
    # The defaults estimate, plan and train name shape this answer too; the length search sets
    # --seq-len itself, so it is not a default there.
    note = defaults_note(cfg, searched=("seq_len",) if args.search == "seq-len" else ())
    if rc == 0 and note and not args.json:
        print(note)
    return rc


def _run_batch(args: argparse.Namespace, cfg: Any, budget: Optional[int]) -> int:
    """The batch search: measured or traced here, or the CUDA model's where no CUDA device is."""
    from memtrain.analysis.maxbatch import find_max_batch  # torch-free --help/estimate/plan

    args.max_search = args.max_search or 4096
    args.multiple_of = args.multiple_of or 1
    if _wants_cuda_model(args, cfg):
        return _run_cuda_model(args, cfg, budget)
    if args.device_type == "cuda":
        cfg = cfg.replace(device="cuda")  # a CUDA device is here: measure on it, as --device cuda
    res = find_max_batch(cfg, budget_bytes=budget, max_batch=args.max_search, multiple_of=args.multiple_of,
                         progress=False if args.json else None, method=args.method)
    out = res.to_dict()
    out["search"] = "batch"
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


def _check_search_flags(args: argparse.Namespace) -> None:
    """Each search's bound is its own flag: --max-batch bounds batches, --max-len lengths."""
    if args.search == "seq-len" and args.max_search is not None:
        raise ConfigError("--max-batch bounds the batch search; with --search seq-len bound the length with --max-len N "
                          "and fix the batch with --batch-size B")
    if args.search == "seq-len" and getattr(args, "seq_len", None) is not None:
        raise ConfigError("--search seq-len finds the sequence length: drop --seq-len (bound the search with --max-len N)")
    if args.search == "batch" and args.max_len is not None:
        raise ConfigError("--max-len bounds the length search: add --search seq-len, or drop --max-len and bound the "
                          "batch search with --max-batch N")


def _refuse_before_the_search(args: argparse.Namespace, cfg: Any, budget: Optional[int]) -> None:
    """The search's refusals that need no model (a budget off CUDA, the batch bounds), said
    before its modules load: the tracer, FSDP and sympy took ~10 s to import before the line came.
    The search checks the same again (the same functions) for callers of the library."""
    if args.search == "batch":
        check_batch_bounds(args.max_search, args.multiple_of or 1)
    if args.gpu is not None or args.device_type == "cuda":
        return  # the CUDA model's path: a card's memory can be the budget (_run_cuda_model says)
    device_type = _device_type_before_search(cfg.train.device)
    require_search_budget(device_type, budget, "the max batch" if args.search == "batch" else "the longest context")


def _device_type_before_search(name: str) -> str:
    """``cpu`` or ``cuda`` for the --device given (the config refused a name that is none of
    auto, cpu, cuda[:N]); a CUDA device that is not here is refused (torch alone loads for it)."""
    if name.startswith("cpu"):
        return "cpu"
    if name != "auto":
        refuse_device_not_here(name)  # a CUDA device that is not here: said before the search's imports
        return "cuda"
    # Whether a CUDA device is here is torch's to say (CUDA_VISIBLE_DEVICES, the driver): torch
    # alone, not the search's modules, loads for it.
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _search_batch(cfg: Any) -> int:
    """The micro-batch a length search holds: --batch-size (or a --config file's) when given,
    else 1 (the question "how long a context fits" is asked of one sequence)."""
    given = getattr(cfg, "given_settings", None) or frozenset()
    return int(cfg.train.batch_size) if "batch_size" in given else 1


def _run_seq_len(args: argparse.Namespace, cfg: Any, budget: Optional[int]) -> int:
    """--search seq-len: the longest sequence length whose step fits (memtrain.analysis.context)."""
    # analysis.context imports torch: loaded only when this search runs
    from memtrain.analysis.context import estimated_longest_context, find_longest_context

    batch = _search_batch(cfg)
    if _wants_cuda_model(args, cfg):
        found = budget_for(budget, args.gpu)
        if found is None:
            raise ConfigError("no CUDA device here to measure on: name the card with --gpu NAME (h100, a100-80gb, "
                              "rtx4090, ...) or give --memory-budget SIZE, and the CUDA model estimates the longest "
                              "context" if args.gpu is None else
                              f"--gpu {args.gpu}: its memory is not in the GPU table; add --memory-budget SIZE")
        budget, source = found
        res = estimated_longest_context(cfg, budget, args.gpu, batch, max_len=args.max_len,
                                        multiple_of=args.multiple_of)
        out = res.to_dict()
        out["budget_source"] = source
        out["note_estimated"] = ("estimated, not measured: no CUDA device here; CUDA kernels' memory rules, the "
                                 "caching-allocator model and the CUDA context (memtrain.analysis.allocator)")
    else:
        if args.device_type == "cuda":
            cfg = cfg.replace(device="cuda")  # a CUDA device is here: measure on it, as --device cuda
        res = find_longest_context(cfg, budget_bytes=budget, batch=batch, max_len=args.max_len,
                                   multiple_of=args.multiple_of, progress=False if args.json else None, method=args.method)
        out = res.to_dict()
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    budget_text = fmt_bytes(res.budget_bytes) if res.budget_bytes else "the device memory"
    size = f"{res.seq_len:,}{longer_fits_mark(res.capped, res.past_fits)}"
    how = ("ESTIMATED with the CUDA model, not measured" if not res.measured else
           f"{res.method}, {len(res.probes)} probes on {res.device}"
           + (f", from the {res.guess_method} guess {res.guess:,}" if res.guess is not None else ""))
    print(f"longest context {size} tokens at batch {res.batch_size} fits {budget_text}: "
          f"peak {fmt_bytes(res.peak_bytes)} ({how})")
    if res.next_seq_len is not None:
        nxt = ("out of device memory" if res.next_peak_bytes is None else fmt_bytes(res.next_peak_bytes) + (
            f", {fmt_bytes(res.next_peak_bytes - res.budget_bytes)} over" if res.budget_bytes else ""))
        print(f"  next length {res.next_seq_len:,} does not fit: {nxt}; lengths in multiples of {res.multiple_of}")
    print(f"  {res.note}")
    if res.capped_note:
        print(f"  {res.capped_note}")
    if not res.measured:
        dm = res.device_memory or {}
        print(f"  reserved {fmt_bytes(dm.get('reserved'))} + CUDA context {fmt_bytes(dm.get('cuda_context'))} "
              f"(allocated {fmt_bytes(dm.get('allocated'))}); run on a CUDA machine to measure")
    return 0


def _wants_cuda_model(args: argparse.Namespace, cfg: Any) -> bool:
    """True when CUDA is asked for (--device-type cuda, --gpu) and no CUDA device is here to
    measure on: the answer is then the CUDA model's estimate."""
    if args.gpu is None and args.device_type != "cuda":
        return False
    cpu_asked = args.device_type == "cpu" or cfg.train.device == "cpu"
    refuse_gpu_off_cuda(args, "cpu" if cpu_asked else "cuda", "names the card the CUDA model assumes: drop "
                        "--device-type cpu/--device cpu, or drop --gpu to search with CPU kernels")
    if cpu_asked:  # --device-type cuda next to --device cpu, no --gpu
        raise ConfigError("--device-type cuda asks for CUDA kernels and --device cpu for the CPU: drop one of them")
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
    out["search"] = "batch"
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
