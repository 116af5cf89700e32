"""`memtrain plan`: the fastest technique set that fits a memory budget."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from memtrain.analysis.estimate import estimate
from memtrain.analysis.estimate.hf import hf_arch, why_not_modelled
from memtrain.analysis.fit import context_line, length_search_bound, longest_context, step_need
from memtrain.analysis.plan import (
    MAX_BATCH_TRACES,
    Candidate,
    candidate_config,
    default_space,
    plan,
    verification,
    verify_config,
)
from memtrain.cli import (
    LOOP_ONLY_FIELDS,
    MODULE_TABLE_FIELDS,
    add_config_flags,
    add_loss_on_flag,
    add_packing_flag,
    defaults_note,
    fmt_bytes,
    register,
)
from memtrain.commands.bench import warn_skipped_lines
from memtrain.commands.estimate import (
    add_device_type_flag,
    add_gpu_flag,
    add_max_len_flag,
    add_model_choice,
    device_type_for,
    refuse_gpu_off_cuda,
    refuse_max_len_when_traced,
    resolve_model,
)
from memtrain.config.argtypes import batch_count, positive_int, user_path
from memtrain.config.run import ConfigError, parse_size
from memtrain.devices.gpu_kinds import has_fp8
from memtrain.devices.numerics import fewest_changes_first, is_standard, numerics_changes, numerics_key, numerics_note
from memtrain.files.bench_store import bench_results_file, latest_settings, read_results_counted, rows_under
from memtrain.report.noise import (
    FACTOR,
    fmt_noise,
    is_noise_twin,
    ppl_noise,
    precision_yardsticks,
    row_precision,
    yardstick,
)


def add_args(p: argparse.ArgumentParser) -> None:
    add_model_choice(p)
    p.add_argument("--memory-budget", "--budget", dest="budget", default=None, metavar="SIZE",
                   help="Memory budget, e.g. 24GiB or 1.5GB (--budget is the older name). Default with --gpu: "
                        "the card's memory from the GPU table.")
    p.add_argument("--max-batch", nargs="?", type=batch_count, const=4096, default=None, metavar="N",
                   help="Find each set's largest batch, up to N (default 4096), instead of keeping "
                        "--batch-size x --grad-accum. N is the search's upper bound, as in maxbatch and bench. "
                        "On a transformers model at most --max-traces candidates are traced.")
    p.add_argument("--max-traces", type=batch_count, default=MAX_BATCH_TRACES, metavar="N",
                   help=f"With --max-batch on a transformers model: trace at most N candidates (default "
                        f"{MAX_BATCH_TRACES}; one takes seconds, a minute at thousands of sequences). Each set "
                        "first gets the batch the analytic model of its layers fits with 5%% kept; the fastest "
                        "are then raised by traces while any are left, and the output says when the cap was reached.")
    add_max_len_flag(p, "The recommended set's longest context")
    p.add_argument("--margin", type=float, default=0.10, help="Safety margin on predictions (default 0.10).")
    p.add_argument("--top", type=int, default=5, help="How many choices to show (default 5).")
    add_device_type_flag(p, "Device the plan is for (kernel facts and cost model); default: from --device.")
    add_gpu_flag(p, "With CUDA kernels: the GPU kind the plan is for (h100, a100, rtx4090, ...): peaks are "
                    "device totals (caching allocator + CUDA context), and --precision fp8 joins the "
                    "search where the kind has FP8 tensor cores.")
    for name, what in (("precisions", "precision"), ("attentions", "attention"), ("checkpointings", "checkpointing"),
                       ("losses", "loss"), ("optims", "optim")):
        p.add_argument(f"--{name}", default=None, metavar="A,B",
                       help=f"Comma-separated {what} values to consider (default: a per-device list).")
    p.add_argument("--verify", action="store_true",
                   help="Train the best choice for a few steps and compare the measured tracked peak.")
    p.add_argument("--verify-steps", type=positive_int, default=2,
                   help="Steps for --verify (default 2; at least 2, so that one is a steady-state step: 1 runs 2).")
    p.add_argument("--results", type=user_path, default=None, metavar="DIR",
                   help="A bench results folder (results.jsonl): show the measured perplexity effect of each "
                        "choice that changes the numerics, where a row with the same numerics exists.")
    p.add_argument("--host-bandwidth", default=None, metavar="RATE",
                   help="Host link bandwidth each way that --offload-activations' copies run at, e.g. 64GB/s "
                        "(measured or from the link: PCIe 5.0 x16 ~50GB/s, NVLink-C2C ~450GB/s); default 25GB/s "
                        "on cuda (PCIe 4.0 x16, pinned copies).")
    p.add_argument("--json", action="store_true", help="Print JSON only.")
    add_config_flags(p, ("model", "technique", "train"), exclude=(*LOOP_ONLY_FIELDS, *MODULE_TABLE_FIELDS, "model"))  # --model is add_model_choice's
    add_loss_on_flag(p)  # --loss-on completion: the answers-only step, sized without data
    add_packing_flag(p)  # --packing pad: the same batch x seq_len step, taken so a train command's flags fit


def parse_rate(text: str) -> float:
    """A transfer rate such as ``64GB/s`` or ``25GiB/s`` (a size per second), in bytes/s."""
    size = text.strip()
    if not size.lower().endswith("/s"):
        raise ConfigError(f"--host-bandwidth {text!r}: write a rate such as 64GB/s")
    try:
        return float(parse_size(size[:-2]))
    except ConfigError:
        # parse_size names a memory size; the user wrote a rate, so the line says how to write one
        raise ConfigError(f"--host-bandwidth {text!r}: write a positive rate such as 64GB/s") from None


def _search_space(args: argparse.Namespace, cfg: Any, device_type: str) -> dict[str, list[str]]:
    """The techniques plan tries: its defaults for the device, narrowed by --precisions etc."""
    space = default_space(cfg, device_type, args.gpu)
    for name, key in (("precisions", "precision"), ("attentions", "attention"), ("checkpointings", "checkpointing"),
                      ("losses", "loss"), ("optims", "optim")):
        value = getattr(args, name)
        if value:
            space[key] = [v.strip() for v in value.split(",") if v.strip()]
            for v in space[key]:
                cfg.replace(**{key: v})  # validates each value (ConfigError names the bad one)
    if "fp8" in space["precision"] and device_type != "cuda":
        # FP8 matmuls need FP8 tensor cores: a plan for a CPU could only recommend a refused run.
        raise ConfigError("--precisions fp8 runs on a CUDA GPU with FP8 tensor cores only; plan for one with "
                          "--device-type cuda --gpu h100, or drop fp8")
    if "fp8" in space["precision"] and not has_fp8(args.gpu):
        # Likewise a card without FP8 tensor cores (an A100), or one not named: the default space
        # leaves fp8 out there, and a plan that asks for it must not rank it as if it ran.
        card = f"--gpu {args.gpu} has no FP8 tensor cores" if args.gpu else "no --gpu names the card"
        raise ConfigError(f"--precisions fp8 needs a GPU with FP8 tensor cores and {card}; plan for one with "
                          "--gpu h100 (or l4, h200, ...), or drop fp8")
    return space


def _budget(args: argparse.Namespace) -> tuple[int, str]:
    """(bytes, where from): --memory-budget, else the --gpu card's memory; a one-line error naming
    both when neither gives one."""
    from memtrain.analysis.fit import budget_for  # torch-free --help

    found = budget_for(parse_size(args.budget) if args.budget is not None else None, args.gpu)
    if found is None:
        raise ConfigError("plan needs a budget: give --memory-budget SIZE (e.g. 24GiB) or --gpu NAME (h100, rtx4090, ...)"
                          if args.gpu is None else
                          f"--gpu {args.gpu}: its memory is not in the GPU table; add --memory-budget SIZE")
    return found


def asked_changes(cfg: Any) -> list[str]:
    """The numerics changes every candidate shares because the command asked for them: plan searches
    precision, attention, checkpointing, loss and optimizer, never LoRA or a sliding window, so
    ``--lora-rank`` or ``--window`` given to plan is no choice of the plan's to report as one."""
    tech = cfg.technique
    return numerics_changes({"lora_rank": tech.lora_rank or tech.qlora, "window": tech.window})


def _print_pick_note(rec: int, number: int, techs: list[dict[str, Any]], asked: list[str]) -> None:
    """The line under ``best:`` that says why the pick is not #1, or that it changes the numerics.
    A change the user asked for (``asked``, e.g. LoRA) is named once as theirs: with ``--lora-rank``
    every candidate trains adapters only, and calling none of them standard would tell a fine-tuner
    that a larger budget could buy a standard run."""
    def beyond_asked(tech: dict[str, Any]) -> list[str]:
        return [note for note in numerics_changes(tech) if note not in asked]

    pick, fastest = beyond_asked(techs[rec]), beyond_asked(techs[0])
    standard = "numerically standard choice" + (f" (apart from what you asked: {'; '.join(asked)})" if asked else "")
    if rec != 0 and not pick:
        print(f"  (#{number}, the fastest {standard}; #1 is faster but: {'; '.join(fastest)})")
    elif rec != 0:
        print(f"  (no {standard} fits; #{number} is the fastest that changes the least: "
              f"{'; '.join(pick)}; #1 is faster but: {'; '.join(fastest)})")
    elif pick:
        print(f"  (no {standard} fits; this one: {'; '.join(pick)})")
    elif asked:
        print(f"  (a {standard})")


def run(args: argparse.Namespace) -> int:
    cfg, arch = resolve_model(args)
    device_type = device_type_for(args, cfg)
    refuse_gpu_off_cuda(args, device_type, "plans for a CUDA GPU kind: add --device-type cuda")
    space = _search_space(args, cfg, device_type)
    if args.top < 1:
        raise ConfigError(f"--top must be >= 1, got {args.top}")
    budget, budget_source = _budget(args)
    _check_max_len(args, cfg, arch, device_type)
    # Every fitting set is ranked (not only --top), so that the fastest numerically standard one
    # can be recommended even when faster non-standard sets fill the top of the list.
    card = _card(args.gpu, device_type)
    res = plan(cfg, budget, device_type, arch, max_batch=args.max_batch is not None, margin=args.margin,
               top=10**6, space=space, max_batch_limit=args.max_batch or 4096, gpu=card,
               host_bandwidth=parse_rate(args.host_bandwidth) if args.host_bandwidth else None,
               progress=False if args.json else None, max_traces=args.max_traces)

    techs = [{**asdict(cfg.technique), **c.techniques} for c in res.candidates]
    rec = fewest_changes_first(techs)[0]  # the fastest of those that change the numerics least
    shown = list(range(min(args.top, len(techs)))) + ([rec] if rec >= args.top else [])
    res.slower += len(res.candidates) - len(shown)  # every fitting set was ranked (top=10**6); these fit but are not shown
    res.candidates = [res.candidates[i] for i in shown]
    techs = [techs[i] for i in shown]
    rec = shown.index(rec)
    measured, beyond, rel_noise, row_noises = (_measured_effects(args.results, techs) if args.results
                                               else ([None] * len(techs), [None] * len(techs), None, [None] * len(techs)))
    if args.verify:
        _check_verify(args, cfg, arch)
        res.verified = _verify(cfg, res.candidates[rec], args.verify_steps)
    out = res.to_dict()
    for c, t, m, b, n in zip(out["candidates"], techs, measured, beyond, row_noises):
        c["numerics"], c["numerics_standard"], c["measured_ppl_effect"] = numerics_note(t), is_standard(t), m
        c["measured_ppl_beyond_noise"], c["measured_ppl_row_noise"] = b, n
    out["measured_ppl_noise"] = rel_noise
    out["recommended"] = rec
    out["budget_source"] = budget_source
    out["longest_context"] = _longest_context(cfg, arch, res.candidates[rec], device_type, budget, res.margin,
                                              args.max_len, card)
    if args.json:
        print(json.dumps(out, indent=2, default=float))
        return 0
    target = f"batch {res.target_batch} x seq {cfg.train.seq_len}" if res.target_batch else f"largest batch, seq {cfg.train.seq_len}"
    source = "" if budget_source == "--budget" else f"{budget_source}; "
    print(f"plan for {fmt_bytes(budget)} ({source}{res.margin:.0%} margin) on {device_type}, {target}; "
          f"{res.evaluated} estimates")
    head = ("#", "predicted peak", "rel. time", "technique set", "numerics")
    rows = [head] + [(str(shown[i] + 1), fmt_bytes(c.peak_bytes), f"{c.relative_time:.2f}", c.label(),
                      d["numerics"] + _measured_text(d["measured_ppl_effect"], d["measured_ppl_beyond_noise"],
                                                     d["measured_ppl_row_noise"]))
                     for i, (c, d) in enumerate(zip(res.candidates, out["candidates"]))]
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(f"  {r[0]:>{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:<{w[3]}}  {r[4]}")
    best = out["candidates"][rec]
    print(f"best: memtrain train {best['config_flags']}")
    if cfg.data.loss_on == "completion" and cfg.data.data_format == "text":
        print("  (--loss-on completion: add the records it trains on, --data FILE --data-format chat, "
              "prompt-completion or auto)")
    _print_pick_note(rec, shown[rec] + 1, techs, asked_changes(cfg))
    note = defaults_note(candidate_config(cfg, res.candidates[rec]))  # the recommended choice's defaults
    if note:
        print(note)
    print("rel. time: modelled step time vs fp32/math/no checkpointing/standard loss at the full batch "
          "(a cost model, not a measurement)" if args.max_batch is None else
          "rel. time: modelled time per token vs the best choice (a cost model, not a measurement)")
    ctx = out["longest_context"]
    if ctx is not None:
        print(f"{context_line(ctx)} with #{shown[rec] + 1}'s techniques, {res.margin:.0%} margin kept")
        print(f"  {ctx['capped_note'] or ctx['note']}")
    if res.verified:
        ver = res.verified
        print(f"verified: measured tracked peak {fmt_bytes(ver['measured_bytes'])} vs predicted "
              f"{fmt_bytes(ver['predicted_bytes'])} ({ver['error']:+.1%}) over {ver['steps']} steps")
    for line in dropped_lines(out["dropped"], res.target_batch):
        print(line)
    for note in res.notes[1:]:  # how the peaks were found, where the first (the cost model) says nothing new
        print(f"note: {note}")
    return 0


def dropped_lines(dropped: dict[str, Any], target_batch: Optional[int]) -> list[str]:
    """plan's "not shown" section: one line per reason a technique set is missing from the table
    (does not fit, not available for this device or run, slower than the shown), so "why not X?" has an answer."""
    lines = []
    no_fit = dropped["does_not_fit"]
    if no_fit["count"]:
        c = no_fit["closest"]
        batch = f"micro-batch 1 x {c['grad_accum']} (batch {target_batch})" if target_batch else "batch 1"
        lines.append(f"  does not fit: {no_fit['count']} set(s), even at {batch}; the closest "
                     f"({c['label'].rsplit(', micro-batch', 1)[0]}) needs {fmt_bytes(c['need_bytes'])} with the margin, "
                     f"{fmt_bytes(c['over_bytes'])} over the budget")
    if dropped["unavailable"]:
        lines += [f"  not available here: {u['technique']} {', '.join(u['values'])}: {u['reason']}"
                  for u in dropped["unavailable"]]
    slower = dropped["slower"]
    if slower["count"]:
        lines.append(f"  slower than the {slower['shown']} shown: {slower['count']} set(s) that fit (--top N shows more)")
    return ["not shown:"] + lines if lines else []


def _card(gpu: Optional[str], device_type: str) -> Optional[str]:
    """The GPU kind whose device totals (caching allocator + CUDA context) the candidates are judged
    by: --gpu, else on CUDA the "default" kind that `estimate --budget` and `maxbatch` assume there.
    Live tensor bytes alone recommended batches those commands say do not fit the same budget."""
    return gpu or ("default" if device_type == "cuda" else None)


def _check_max_len(args: argparse.Namespace, cfg: Any, arch: Any, device_type: str) -> None:
    """--max-len, checked before the search: a bound the model refuses (a learned position table
    has no row past it) and a traced model (no longest context to bound) are refused at once."""
    if args.max_len is None:
        return
    if arch is None:
        refuse_max_len_when_traced(args.max_len, cfg, device_type)
    length_search_bound(cfg, args.max_len)  # the technique sets keep positions and window: one bound for all


def _longest_context(cfg: Any, arch: Any, cand: Candidate, device_type: str, budget: int,
                     margin: float, max_len: Optional[int] = None,
                     gpu: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The longest sequence length (at most ``max_len``, --max-len) the recommended technique set
    fits at its micro-batch, with the plan's margin kept (memtrain.analysis.fit.longest_context over
    the analytic estimate);
    None where the estimator does not model the model (a traced transformers model:
    ``memtrain maxbatch --search seq-len`` traces it). With ``gpu`` on CUDA each length is judged
    by what the card holds (caching allocator + CUDA context), as the plan judged its candidates:
    live tensor bytes alone passed lengths whose device total was over the margin."""
    if arch is None:
        if why_not_modelled(cfg, device_type) is not None:
            return None
        arch = hf_arch(cfg.model.model)
    at = candidate_config(cfg, cand)

    def need(c: Any) -> float:
        if gpu is not None and device_type == "cuda":
            return step_need(c, arch, device_type, gpu)[0]
        return float(estimate(c, arch, device_type).peak_bytes)

    return longest_context(need, at, budget / (1 + margin), cand.batch_size, max_len=max_len)


def _check_verify(args: argparse.Namespace, cfg: Any, arch: Any) -> None:
    """--verify trains the recommended set: refused where that run cannot train (before any output)."""
    if arch is not None and arch.name != "gpt2":
        raise ConfigError(f"--verify trains our GPT-2-style model; --model {args.preset} can only be planned")
    if cfg.data.loss_on == "completion" and cfg.data.data_format == "text":
        # The check's run trains on the config's data: the embedded text has no answers.
        raise ConfigError("--verify trains on the run's data, and --loss-on completion needs records of chats or "
                          "prompt-completions: give data and data_format in a --config file, or drop --verify")


def _verify(cfg: Any, cand: Candidate, steps: int) -> dict[str, Any]:
    """--verify: train the recommended candidate for ``steps`` steps and compare its measured
    tracked peak with the prediction. The one place plan crosses the torch line: the search
    above is arithmetic, so training (and torch) is imported only when --verify asks for it."""
    from memtrain.training.train import train  # the torch line, crossed on --verify only

    run_cfg = verify_config(cfg, cand, steps)
    return verification(cand, run_cfg, train(run_cfg, progress=False))


def _measured_effects(results_dir: str, techs: list[dict]) -> tuple[list[Optional[float]], list[Optional[bool]],
                                                                    Optional[float], list[Optional[float]]]:
    """Per candidate: the measured PPL change of a bench row with the same numerics against a
    numerically standard row of the same results (None where no such pair exists), and whether
    that change is beyond the bench's noise (None where the results measured none); with the noise
    itself (the first yardstick) and each candidate's own (its precision's twins where they ran,
    memtrain.report.noise.row_noise). The reference is the row the bench's noise twins repeat when it is standard (the
    noise is measured around it), else the standard row with the lowest loss; twins are never
    a candidate's row."""
    path = Path(results_dir)
    bench_results_file(path, "plan --results")
    results = _bench_rows(path)
    rows = [r for r in results if r.get("status") == "ok" and r.get("val_loss") is not None
            and not is_noise_twin(r.get("technique"))]
    standard = [r for r in rows if is_standard(r["config"].get("technique", {}))]
    if not standard:
        return [None] * len(techs), [None] * len(techs), None, [None] * len(techs)
    noise = ppl_noise(results)
    base = next((r for r in standard if noise and r.get("technique") == noise["base"]), None)
    ref = base["val_loss"] if base else min(r["val_loss"] for r in standard)
    rel_noise = noise["rel_noise"] if base and noise else None
    yardsticks = precision_yardsticks(results, noise)  # the twins are searched once, not per candidate
    effects: list[Optional[float]] = []
    beyond: list[Optional[bool]] = []
    noises: list[Optional[float]] = []
    for t in techs:
        same = [r for r in rows if numerics_key(r["config"]) == numerics_key({"technique": t})]
        effect = None if is_standard(t) or not same else math.exp(same[0]["val_loss"] - ref) - 1
        effects.append(effect)
        # Judged against the twins of the row's own precision where they ran (row_noise); no
        # yardstick where the noise was not measured, or measured as zero (twins equal to the digit).
        own = yardstick(noise, yardsticks, row_precision(same[0])) if same and noise else None
        row_rel = own[1] if own and rel_noise is not None else rel_noise
        noises.append(row_rel)
        beyond.append(None if effect is None or not row_rel else abs(effect) > FACTOR * row_rel)
    return effects, beyond, rel_noise, noises


def _bench_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of ``path``/results.jsonl that the last bench there ran (those under its settings,
    as ``memtrain report`` takes them; one note counts the others). A file without rows (empty,
    or only unreadable lines) or with unreadable lines is said in one warning: the plan stands
    without measured effects, but a silent empty column would read as "nothing measured differs"."""
    read = read_results_counted(path)
    if not read.rows:
        skipped = f" ({read.skipped} unreadable line(s) skipped)" if read.skipped else ""
        print(f"warning: {path}/results.jsonl holds no rows{skipped}; the plan shows no measured PPL effect",
              file=sys.stderr)
        return read.rows
    warn_skipped_lines(path, {"skipped_lines": read.skipped})
    # One bench's rows, as `memtrain report` compares them: a row another bench ran under other
    # settings (batch, steps, data) is no measure of the same change.
    chosen = latest_settings(read.rows)
    rows = rows_under(read.rows, chosen)
    if len(rows) < len(read.rows):
        print(f"note: {path}/results.jsonl holds {len(read.rows) - len(rows)} row(s) a bench ran under other settings; "
              f"the measured effects are the last bench's ({len(rows)} row(s); `memtrain report {path}` names the "
              "others)", file=sys.stderr)
    return rows


def _measured_text(effect: Optional[float], beyond: Optional[bool], rel_noise: Optional[float]) -> str:
    if effect is None:
        return ""
    if beyond is None:
        return f" (measured: PPL {effect:+.2%})"
    verdict = "beyond" if beyond else "within"
    return f" (measured: PPL {effect:+.2%}, {verdict} {FACTOR:.0f}x the bench's noise of {fmt_noise(rel_noise or 0.0)})"


# The description states the pick rule (memtrain.devices.numerics.fewest_changes_first): "the
# fastest" alone promised a set that changes the numerics over a standard one nearly as fast.
register("plan", "Find the fastest technique set whose training step fits a memory budget, among those "
         "that change the numerics least (a numerically standard one when one fits).", add_args, run)
