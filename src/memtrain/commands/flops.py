"""`memtrain flops`: counted FLOPs and bytes per operation class of one training step, the rule of
thumb beside them, and where each class sits on a GPU's roofline (optionally a PNG, optionally
with measured kernel times).

For memtrain's GPT the figures come from the analytic inventory
(:mod:`memtrain.analysis.flops.inventory`, no torch): the table a fake-tensor count gives, by
arithmetic. Other runs (a transformers --model, LoRA, --window, ...), and any run with --count,
are counted under FakeTensorMode."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from memtrain.analysis.estimate import check_analytic_size
from memtrain.analysis.flops.profile import profile_op_classes
from memtrain.analysis.flops.roofline import flops_report, resolve_roof
from memtrain.cli import LOOP_ONLY_FIELDS, MODULE_TABLE_FIELDS, add_config_flags, config_from_args, register
from memtrain.config.argtypes import gpu_name, user_path
from memtrain.config.run import ConfigError
from memtrain.errors import one_line
from memtrain.files.results import refuse_odd_destination
from memtrain.report.labels import model_label
from memtrain.report.roofline import plot_roofline
from memtrain.training.preflight import check_writable_file


def add_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, ("model", "technique", "train"), exclude=(*LOOP_ONLY_FIELDS, *MODULE_TABLE_FIELDS))
    p.add_argument("--gpu", default=None, metavar="NAME", type=gpu_name(None),
                   help="GPU whose roofline to use: h100, h200, a100-80gb-sxm, l4, rtx-4090, ... "
                        "(default: the visible CUDA GPU, else h100)")
    p.add_argument("--json", action="store_true", help="Print the report as JSON instead of tables.")
    p.add_argument("--plot", type=user_path, metavar="FILE.png", default=None, help="Write the roofline plot to this PNG.")
    p.add_argument("--profile", action="store_true",
                   help="Also time each operation class with torch.profiler on the CUDA GPU and place "
                        "measured points (needs a GPU).")
    p.add_argument("--profile-steps", type=int, default=5, metavar="N", help="Profiled steps (after 3 warm-up steps; default 5).")
    p.add_argument("--count", action="store_true",
                   help="Count the step under fake tensors (torch) even where the analytic inventory answers "
                        "(memtrain's GPT without LoRA, --window, selective checkpointing or a CUDA-only attention "
                        "kernel); the two give the same figures.")


def _g(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _signed_g(x: float) -> str:
    """GFLOP with their sign, a value that rounds to zero as +0.00 (a "+" before _g's text printed
    "+-0.00" for a small negative)."""
    return f"{round(x / 1e9, 2) + 0.0:+,.2f}"  # + 0.0 turns the -0.0 of rounding into 0.0


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


def _unexplained_cause(unexplained: float, counted: float, tech: dict[str, Any]) -> str:
    """What a non-zero remainder of the reconciliation comes from: the techniques on that change
    the work the rule describes, or, with none on, that the rule's terms miss something."""
    if abs(unexplained) < 1e-6 * max(counted, 1):
        return ""
    causes = [c for c, on in (("LoRA computes no gradients of frozen weights", tech.get("lora_rank")),
                              ("the sliding window computes only the band", tech.get("window") is not None)) if on]
    if causes:
        return f" (a technique changes the work: {'; '.join(causes)})"
    return " (no technique on changes the work: the rule's terms do not describe this model's step)"


def render(report: dict[str, Any]) -> str:
    """The human-readable tables of a ``flops_report``."""
    gpu = report["gpu"]
    cfg = report["config"]
    m, tech = cfg["model"], cfg["technique"]
    measured = "measured" in report
    lines = [
        f"one training step: {model_label(m)}, {m['n_layers']} layers, {m['n_heads']} heads, "
        f"d_ff {m['d_ff']}, vocab {m['vocab_size']} ({report['parameters']:,} parameters); "
        f"batch {cfg['batch_size']} x seq {cfg['seq_len']} x grad-accum {cfg['grad_accum']} = "
        f"{report['tokens']:,} tokens; precision {tech['precision']}, checkpointing {tech['checkpointing']}",
        f"roofline: {gpu['name']}, {gpu['peak_flops'] / 1e12:.1f} TFLOP/s {gpu['dtype']} matmul peak, "
        f"{gpu['vector_peak_flops'] / 1e12:.1f} TFLOP/s FP32 vector, {gpu['mem_bandwidth'] / 1e12:.2f} TB/s "
        f"-> ridge {gpu['ridge']:.1f} FLOP/B (matmuls), {gpu['vector_ridge']:.1f} FLOP/B (element-wise)",
        "",
    ]
    head = f"{'operation class':<34} {'GFLOP':>9} {'MB moved':>10} {'FLOP/B':>8} {'roof TFLOP/s':>12} {'est. time':>9}"
    head += f" {'measured':>9} {'achieved':>9}" if measured else ""
    head += "  bound"
    lines += [head, "-" * len(head)]
    for o in report["ops"]:
        row = (f"{o['label']:<34} {_g(o['flops']):>9} {o['bytes'] / 1e6:>10,.1f} {o['intensity']:>8.2f} "
               f"{o['attainable_flops_per_s'] / 1e12:>12.2f} {_pct(o['est_time_share']):>9}")
        if measured:
            t = o.get("measured_time_s")
            a = o.get("achieved_flops_per_s")
            row += f" {(_pct(o['measured_time_share']) if t else '-'):>9} {(f'{a / 1e12:.2f}T' if a else '-'):>9}"
        lines.append(row + f"  {o['bound']}")
    ph = report["phases"]
    lines += [
        "-" * len(head),
        f"{'forward':<34} {_g(ph['forward']['flops']):>9} {ph['forward']['bytes'] / 1e6:>10,.1f}   "
        f"({_g(ph['forward']['counted_flops'])} counted by FlopCounterMode)",
        f"{'backward':<34} {_g(ph['backward']['flops']):>9} {ph['backward']['bytes'] / 1e6:>10,.1f}   "
        f"({_g(ph['backward']['counted_flops'])} counted)",
        f"{'recompute (in backward)':<34} {_g(ph['recompute']['flops']):>9} {ph['recompute']['bytes'] / 1e6:>10,.1f}   "
        f"({_g(ph['recompute']['counted_flops'])} counted)",
        f"{'optimizer update + clipping':<34} {_g(ph['optimizer']['flops']):>9} {ph['optimizer']['bytes'] / 1e6:>10,.1f}   (analytic)",
        f"{'total per step':<34} {_g(report['total_flops']):>9} {report['total_bytes'] / 1e6:>10,.1f}   "
        f"roofline time estimate {report['est_step_time_s'] * 1e3:.2f} ms",
        "",
    ]
    rule, rec = report["rule"], report["reconciliation"]
    counted = rec["counted_forward_backward"]
    diff = counted / report["rule_flops"] - 1 if report["rule_flops"] else 0.0
    # The attention term's width: d_model, or heads x head_dim where a config sets the head apart.
    width = "d_model" if rule["attention_width"] == m["d_model"] else f"heads x head_dim ({rule['attention_width']:,.0f})"
    lines += [
        f"rule of thumb 6ND + attention: {_g(report['rule_flops'])} GFLOP = 6 x {rule['rule_params'] / 1e6:.2f}M params "
        f"x {report['tokens']:,} tokens ({_g(rule['six_n_d'])}) + 12 x layers x {width} x seq x tokens ({_g(rule['attention'])})",
        f"counted forward + backward:    {_g(counted)} GFLOP ({diff * 100:+.2f}% vs the rule)",
        f"  biases and norm weights are in 6N but do element-wise work only: {_g(rec['bias_and_norm_params'])} GFLOP",
    ]
    if rec["untied_embedding_lookup"]:
        lines.append(f"  the untied token embedding is in 6N but is a lookup (no FLOPs): {_g(rec['untied_embedding_lookup'])} GFLOP")
    if rec.get("fused_attention_backward_scores"):
        lines.append("  the fused attention kernel's backward computes the scores q k^T again, which the rule leaves "
                     f"out: {_signed_g(rec['fused_attention_backward_scores'])} GFLOP")
    head = "the untied LM head is a matmul" if rec["untied_embedding_lookup"] else "the tied LM head is counted once, as a matmul"
    position = "the position table is a lookup (the rule drops it)" if rule.get("position_params") else "positions need no parameters"
    lines += [
        f"  left unexplained: {_g(rec['unexplained'])} GFLOP" + _unexplained_cause(rec["unexplained"], counted, tech),
        f"  the counter counts the full seq x seq score matrix (causal half included), as the rule does; {head}; "
        f"{position}; embeddings are lookups (0 FLOPs).",
        f"  the step also runs {_g(ph['recompute']['counted_flops'])} GFLOP of recompute, "
        f"{_g(report['total_flops'] - report['counter_flops'] - ph['optimizer']['flops'])} GFLOP of element-wise work "
        f"and {_g(ph['optimizer']['flops'])} GFLOP of optimizer update that the rule leaves out.",
    ]
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    if measured:
        meas = report["measured"]
        lines += ["", f"measured on {meas['device']}: {meas['step_time_s'] * 1e3:.2f} ms of kernels per step "
                  f"(sum over classes, recorder active; see docs/performance.md)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args, derive_max_seq_len=True)

    check_analytic_size(cfg.model)  # before torch is imported: an absurd size costs nothing
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot {args.plot!r} must name a .png file, e.g. --plot roofline.png")
    if args.plot:
        refuse_odd_destination(Path(args.plot), f"--plot {args.plot!r}")  # a link there is never written through
        # Written last, after a count or a --profile run: a folder it cannot be written in is said now.
        check_writable_file(args.plot, "--plot")
    if args.profile_steps <= 0:
        raise ConfigError(f"--profile-steps must be positive, got {args.profile_steps}")
    resolve_roof(args.gpu, cfg.technique.precision)  # a bad --gpu fails before any counting
    measured = device = None
    if args.profile:
        # torch loads only for --profile, which trains
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--profile times kernels on a CUDA GPU and none is visible; drop --profile "
                              "for counted FLOPs and bytes (they do not need a GPU)")
        if cfg.train.device == "cpu":
            raise ConfigError("--profile needs --device cuda (or auto); the roofline is a GPU's")
        from memtrain.runtime.env import device_name, resolve_device  # torch-free --help/estimate/plan

        measured = profile_op_classes(cfg, steps=args.profile_steps)
        device = device_name(resolve_device(cfg.train.device))
    report = flops_report(cfg, args.gpu, measured, device, count=args.count)
    if args.plot:
        plot_roofline(report, Path(args.plot))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render(report))
        if args.plot:
            print(f"wrote {one_line(str(args.plot))}")
    return 0


register("flops", "Counted FLOPs and bytes per operation class of one training step, the 6ND rule "
         "beside them, and a roofline (--plot FILE.png, --gpu NAME, --profile on a GPU).", add_args, run)
