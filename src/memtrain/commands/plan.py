"""`memtrain plan`: the fastest technique set that fits a memory budget."""

from __future__ import annotations

import argparse
import json

from memtrain.argtypes import positive_int
from memtrain.cli import add_config_flags, fmt_bytes, register
from memtrain.commands.estimate import add_model_choice, device_type_for, resolve_model


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_choice(p)
    p.add_argument("--budget", required=True, help="Memory budget, e.g. 24GiB or 1.5GB.")
    p.add_argument("--max-batch", action="store_true",
                   help="Find each set's largest batch instead of keeping --batch-size x --grad-accum.")
    p.add_argument("--margin", type=float, default=0.10, help="Safety margin on predictions (default 0.10).")
    p.add_argument("--top", type=int, default=5, help="How many choices to show (default 5).")
    p.add_argument("--device-type", choices=("cpu", "cuda"), default=None,
                   help="Device the plan is for (kernel facts and cost model); default: from --device.")
    for name, what in (("precisions", "precision"), ("attentions", "attention"), ("checkpointings", "checkpointing"),
                       ("losses", "loss"), ("optims", "optim")):
        p.add_argument(f"--{name}", default=None, metavar="A,B",
                       help=f"Comma-separated {what} values to consider (default: a per-device list).")
    p.add_argument("--verify", action="store_true",
                   help="Train the best choice for a few steps and compare the measured tracked peak.")
    p.add_argument("--verify-steps", type=positive_int, default=2, help="Steps for --verify (default 2).")
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    add_config_flags(p, ("model", "technique", "train"))


def run(args: argparse.Namespace) -> int:
    from memtrain.config import ConfigError, parse_size
    from memtrain.plan import default_space, plan, verify

    cfg, arch = resolve_model(args)
    device_type = device_type_for(args, cfg)
    space = default_space(cfg, device_type)
    for name, key in (("precisions", "precision"), ("attentions", "attention"), ("checkpointings", "checkpointing"),
                      ("losses", "loss"), ("optims", "optim")):
        value = getattr(args, name)
        if value:
            space[key] = [v.strip() for v in value.split(",") if v.strip()]
            for v in space[key]:
                cfg.replace(**{key: v})  # validates each value (ConfigError names the bad one)
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    budget = parse_size(args.budget)
    res = plan(cfg, budget, device_type, arch, max_batch=args.max_batch, margin=args.margin, top=args.top,
               space=space)
    if args.verify:
        if arch.name != "gpt2":
            raise ConfigError(f"--verify trains our GPT-2-style model; --model {args.preset} can only be planned")
        res.verified = verify(cfg, res.candidates[0], steps=args.verify_steps, arch=arch)
    if args.json:
        print(json.dumps(res.to_dict(), indent=2, default=float))
        return 0
    target = f"batch {res.target_batch} x seq {cfg.train.seq_len}" if res.target_batch else f"largest batch, seq {cfg.train.seq_len}"
    print(f"plan for {fmt_bytes(budget)} ({res.margin:.0%} margin) on {device_type}, {target}; "
          f"{res.evaluated} estimates")
    head = ("#", "predicted peak", "rel. time", "technique set")
    rows = [head] + [(str(i + 1), fmt_bytes(c.peak_bytes), f"{c.relative_time:.2f}", c.label())
                     for i, c in enumerate(res.candidates)]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print(f"  {r[0]:>{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]}")
    best = res.to_dict()["candidates"][0]
    print(f"best: memtrain train {best['config_flags']}")
    print("rel. time: modelled step time vs fp32/math/no checkpointing/standard loss at the full batch "
          "(a cost model, not a measurement)" if not args.max_batch else
          "rel. time: modelled time per token vs the best choice (a cost model, not a measurement)")
    if res.verified:
        ver = res.verified
        print(f"verified: measured tracked peak {fmt_bytes(ver['measured_bytes'])} vs predicted "
              f"{fmt_bytes(ver['predicted_bytes'])} ({ver['error']:+.1%}) over {ver['steps']} steps")
    return 0


register("plan", "Find the fastest technique set whose training step fits a memory budget.", add_args, run)
