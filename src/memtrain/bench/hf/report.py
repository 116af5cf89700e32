"""The comparison's report: per-row medians and paired ratios (ours / theirs), written as
``compare_hf.json`` and ``compare_hf.md``; ``--profile``'s per-phase table."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

from memtrain.bench.hf.lockstep import window_overlap_s
from memtrain.bench.hf.rows import COMMANDS_FILE, REPORT_JSON, REPORT_MD, SIDES, config_hash, probe_at, read_runs
from memtrain.files.results import write_json_atomic, write_text_atomic
from memtrain.report.labels import hardware_text
from memtrain.techniques.facts import MEMORY_CATEGORIES


def _median(xs: list[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per preset and side: medians over repetitions; paired step-time ratios per repetition."""
    table = []
    for row in rows:
        name, cfg, plan = row["preset"], row["config"], row["plan"]
        h = config_hash(cfg)
        entry: dict[str, Any] = {"preset": name, "hf_status": plan.status, "hf_missing": plan.missing,
                                 "hf_mapping": plan.mapping, "hf_training_args": plan.training_args,
                                 "hf_attn_implementation": plan.attn_implementation,
                                 "attention": cfg.technique.attention, "sides": {}}
        mine = [r for r in runs if r["preset"] == name and r["config_hash"] == h]
        for side in SIDES:
            rs = [r for r in mine if r["side"] == side]
            ok = [r["result"] for r in rs if r["result"].get("status") == "ok"]
            if not ok:
                entry["sides"][side] = {"status": rs[-1]["result"].get("status") if rs else "not run",
                                        "error": rs[-1]["result"].get("error") if rs else None}
                continue
            first = ok[0]
            mb = next((r.get("max_batch") for r in ok if r.get("max_batch")), None)
            peaks = [r["memory"]["peak_bytes"] for r in ok if r["memory"].get("peak_bytes") is not None]
            medians = [r["step_time_s"]["median"] for r in ok]
            tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum * cfg.train.seq_len
            step = _median(medians)
            entry["sides"][side] = {
                "status": "ok",
                "repeats": len(ok),
                "step_time_s": step,
                "step_time_runs_s": medians,
                "step_time_p10_s": _median([r["step_time_s"]["p10"] for r in ok]),
                "step_time_p90_s": _median([r["step_time_s"]["p90"] for r in ok]),
                "tokens_per_s": tokens_per_step / step if step else None,
                "peak_bytes": max(peaks) if peaks else None,
                "peak_bytes_runs": peaks,
                "by_category": first["memory"].get("by_category"),
                "peak_phase": first["memory"].get("peak_phase"),
                "max_allocated_bytes": first["memory"].get("max_allocated_bytes"),
                "max_reserved_bytes": first["memory"].get("max_reserved_bytes"),
                "val_ppl": _median([r["val_ppl"] for r in ok]),
                "train_loss": _median([r["train_loss"] for r in ok]),
                "parameters": first.get("parameters"),
                "trainable_parameters": first.get("trainable_parameters"),
                "max_batch": (mb or {}).get("batch_size"),
                "max_batch_peak_bytes": (mb or {}).get("peak_bytes"),
                "max_batch_error": (mb or {}).get("error"),
                "traced_peak_at_run_batch": probe_at(mb, cfg.train.batch_size),
            }
        # Paired ratios: the two sides of one repetition ran together (lockstep) or back to back.
        pairs, overlaps, per_step = [], [], []
        skip = max(cfg.train.warmup_timing_steps, 2)  # the steps StepTimer leaves out (metered + warm-up)
        for rep in sorted({r["rep"] for r in mine}):
            by_side = {r["side"]: r["result"] for r in mine if r["rep"] == rep and r["result"].get("status") == "ok"}
            if len(by_side) == 2:
                pairs.append(by_side["ours"]["step_time_s"]["median"] / by_side["theirs"]["step_time_s"]["median"])
                wo, wt = (by_side[s].get("step_windows") or [] for s in SIDES)
                overlaps.append(window_overlap_s(wo, wt))
                lockstep = all(r.get("lockstep") for r in mine if r["rep"] == rep)
                if lockstep and len(wo) == len(wt):
                    # Step k of ours and step k of theirs ran back to back, seconds apart: their
                    # ratio is the least load-sensitive figure a shared machine gives.
                    per_step += [(eo - so) / (et - st) for (so, eo), (st, et) in list(zip(wo, wt))[skip:]]
        entry["paired_step_ratios"] = pairs
        entry["step_overlap_s"] = overlaps
        entry["per_step_ratios"] = per_step
        o, t = entry["sides"].get("ours", {}), entry["sides"].get("theirs", {})
        if o.get("status") == "ok" and t.get("status") == "ok":
            def ratio(key: str) -> Optional[float]:
                a, b = o.get(key), t.get(key)  # noqa: B023 - called at once, within this iteration
                return a / b if a is not None and b else None

            entry["ratios"] = {k: ratio(k) for k in ("peak_bytes", "step_time_s", "tokens_per_s", "val_ppl", "max_batch",
                                                    "max_allocated_bytes")}
            entry["ratios"]["paired_step_time_median"] = _median(pairs)
            if per_step:
                q = statistics.quantiles(per_step, n=4) if len(per_step) > 1 else [per_step[0]] * 3
                entry["ratios"]["per_step"] = {"median": q[1], "q1": q[0], "q3": q[2], "n": len(per_step),
                                               "ours_faster_share": sum(r < 1 for r in per_step) / len(per_step)}
        table.append(entry)
    return table



def mib(b: Optional[float]) -> str:
    return "n/a" if b is None else f"{b / 2**20:,.1f}"


def num(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def _repetitions(report: dict[str, Any], settings: dict[str, Any]) -> str:
    """Repetitions behind the report's rows (a --report-only run does not know the count it
    rebuilds): the recorded range, or the requested count when nothing was recorded."""
    counts = {side["repeats"] for row in report.get("rows", []) for side in row.get("sides", {}).values()
              if side.get("status") == "ok"}
    if not counts:
        return str(settings["repeats"])
    return str(min(counts)) if len(counts) == 1 else f"{min(counts)} to {max(counts)}"


def _provenance_lines(report: dict[str, Any]) -> list[str]:
    """The report's head: command, commit, hardware, settings, and how to read its figures."""
    env, s = report["env"], report["settings"]
    lines = [
        "# memtrain vs Hugging Face Trainer",
        "",
        *(f"- command: `{c}`" for c in report.get("commands") or [report["command"]]),
        f"- commit: `{', '.join(report.get('commits') or [str(env.get('commit'))])}`; memtrain {env.get('memtrain')}, "
        f"torch {env.get('torch')}, "
        f"transformers {report.get('transformers')}, python {env.get('python')}",
        f"- hardware: {hardware_text(env)}, {env.get('host_threads')} torch threads"
        + (f", {env.get('gpu_memory_bytes', 0) / 2**30:.0f} GiB" if env.get("gpu_memory_bytes") else ""),
        f"- finished: {report['finished']}; wall time {report['wall_s'] / 60:.1f} min",
        (f"- model: `{s['model']}` (a transformers model, trained by memtrain through its model seam and by the "
         "Trainer as is)" if s.get("model") else "- model: memtrain's GPT; the Trainer's GPT2LMHeadModel loaded with its weights"),
        f"- scale `{s['scale']}`: batch {s['batch_size']}, seq {s['seq_len']}, {s['steps']} steps "
        f"({s['warmup_steps']} warm-up), grad_accum {s['grad_accum']}, dropout {s['dropout']}; "
        f"{_repetitions(report, s)} repetition(s); each side in a fresh process; "
        + ("lockstep: both sides of a preset run at once, taking turns step by step (no timed step overlaps "
           "other work of either side), the first turn alternating between rows and repetitions"
           if s.get("lockstep") else "sides one after the other, which one first alternating")
        + ("; HF given memtrain's LR schedule (--exact-schedule)" if s.get("exact_schedule") else ""),
        (f"- max batch: budget {s['budget']}, at most {s['max_batch']}, method {s['maxbatch_method']} on both sides"
         if s.get("maxbatch_method") else "- max batch: not searched (--no-maxbatch)"),
        "",
        "Peak = tracked live tensor bytes of the steady-state step (memtrain.metrics.MemoryMeter, same "
        "meter and steps on both sides). Step time = median over timed steps (metered and warm-up steps "
        "excluded), median over repetitions; on a shared machine the absolute times move with other "
        "people's load, so compare sides with the ratios. Ratios are ours / theirs: below 1 is better for "
        "peak, step time and PPL, above 1 is better for tokens/s and max batch. The per-step-pair ratio "
        "divides ours' step k by theirs' step k (run back to back in lockstep) over every timed step of "
        "every repetition: the figure to trust for speed."
        + ("" if s.get("exact_schedule") else
           " Val PPL: both sides start from the same weights, but each follows its own learning-rate "
           "schedule (memtrain's; the Trainer's cosine_with_min_lr), so after a short run the PPL ratio "
           "mostly compares the schedules; --exact-schedule gives the Trainer memtrain's."),
    ]
    return lines


def _results_lines(report: dict[str, Any]) -> list[str]:
    """The results table: each preset's peak, step time, tokens/s, val PPL and max batch, both sides."""
    s = report["settings"]
    lines = [
        "",
        "## Results",
        "",
        "| preset | HF match | peak MiB ours | peak MiB HF | step s ours | step s HF | tok/s ours | tok/s HF "
        "| val PPL ours | val PPL HF | max batch ours | max batch HF |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in report["rows"]:
        o, t = e["sides"].get("ours", {}), e["sides"].get("theirs", {})
        if e["hf_status"] == "none":
            lines.append(f"| {e['preset']} | no HF equivalent | | | | | | | | | | |")
            continue

        def batch(x: Optional[int]) -> str:
            # A batch equal to the search's cap may not be the largest that fits.
            return num(x, "{}") if x is None or x != s.get("max_batch") else f">= {x} (cap)"

        def cell(side: dict[str, Any], key: str, f: Callable[[Any], str]) -> str:
            return f(side.get(key)) if side.get("status") == "ok" else side.get("status", "n/a")

        lines.append(
            f"| {e['preset']} | {e['hf_status']} | {cell(o, 'peak_bytes', mib)} | {cell(t, 'peak_bytes', mib)} "
            f"| {cell(o, 'step_time_s', num)} | {cell(t, 'step_time_s', num)} "
            f"| {cell(o, 'tokens_per_s', lambda x: num(x, '{:,.0f}'))} | {cell(t, 'tokens_per_s', lambda x: num(x, '{:,.0f}'))} "
            f"| {cell(o, 'val_ppl', lambda x: num(x, '{:,.1f}'))} | {cell(t, 'val_ppl', lambda x: num(x, '{:,.1f}'))} "
            f"| {cell(o, 'max_batch', batch)} | {cell(t, 'max_batch', batch)} |")
    return lines


def _ratio_lines(report: dict[str, Any]) -> list[str]:
    """The ratios table (ours / theirs), with the per-step-pair ratio to trust for speed."""
    lines: list[str] = []
    lines += ["", "## Ratios (ours / theirs)", "",
              "| preset | peak | step time | step time, per run pair | step time, per step pair: median [IQR] (n) "
              "| tokens/s | val PPL | max batch | steps overlapping, s |",
              "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for e in report["rows"]:
        r = e.get("ratios")
        if not r:
            continue
        pairs = ", ".join(f"{p:.2f}" for p in e.get("paired_step_ratios", []))
        ps = r.get("per_step")
        per_step = f"**{ps['median']:.2f}** [{ps['q1']:.2f}, {ps['q3']:.2f}] ({ps['n']})" if ps else "n/a"
        lines.append(f"| {e['preset']} | {num(r['peak_bytes'])} | {num(r['step_time_s'])} | {pairs} | {per_step} "
                     f"| {num(r['tokens_per_s'])} | {num(r['val_ppl'], '{:.3f}')} | {num(r['max_batch'])} "
                     f"| {num(sum(e.get('step_overlap_s') or [0.0]), '{:.1f}')} |")
    return lines


def _allocator_lines(report: dict[str, Any]) -> list[str]:
    """The CUDA allocator peaks table, where any row has them (nothing otherwise)."""
    lines: list[str] = []
    if any((e["sides"].get("ours", {}).get("max_allocated_bytes") is not None) for e in report["rows"]):
        lines += ["", "## CUDA allocator peaks (whole run)", "",
                  "| preset | max allocated MiB ours | HF | max reserved MiB ours | HF |", "|---|---:|---:|---:|---:|"]
        for e in report["rows"]:
            o, t = e["sides"].get("ours", {}), e["sides"].get("theirs", {})
            lines.append(f"| {e['preset']} | {mib(o.get('max_allocated_bytes'))} | {mib(t.get('max_allocated_bytes'))} "
                         f"| {mib(o.get('max_reserved_bytes'))} | {mib(t.get('max_reserved_bytes'))} |")
    return lines


def _category_lines(report: dict[str, Any]) -> list[str]:
    """Memory at the peak by category, a line per preset and side that finished."""
    lines: list[str] = []
    lines += ["", "## Memory at the peak, by category (MiB)", "",
              "| preset | side | " + " | ".join(MEMORY_CATEGORIES) + " | peak phase "
              "| traced peak at run batch | params (trainable) |",
              "|---|---|" + "---:|" * len(MEMORY_CATEGORIES) + "---|---:|---|"]
    for e in report["rows"]:
        for side in SIDES:
            d = e["sides"].get(side, {})
            if d.get("status") != "ok" or not d.get("by_category"):
                continue
            c = d["by_category"]
            lines.append(f"| {e['preset']} | {side} | " + " | ".join(mib(c.get(k)) for k in MEMORY_CATEGORIES)
                         + f" | {d.get('peak_phase')} | {mib(d.get('traced_peak_at_run_batch'))} "
                         f"| {num(d.get('parameters'), '{:,}')} ({num(d.get('trainable_parameters'), '{:,}')}) |")
    return lines


def _mapping_lines(report: dict[str, Any]) -> list[str]:
    """How each preset maps onto the Trainer: its settings, mapping lines and what HF lacks."""
    lines: list[str] = []
    lines += ["", "## How each preset maps onto the Trainer", ""]
    for e in report["rows"]:
        lines.append(f"- **{e['preset']}** ({e['hf_status']}; attention `{e['attention']}`, "
                     f"attn_implementation `{e['hf_attn_implementation']}`, "
                     f"TrainingArguments `{json.dumps(e['hf_training_args'])}`)")
        for m in e["hf_mapping"]:
            lines.append(f"  - {m}")
        for m in e["hf_missing"]:
            lines.append(f"  - missing in HF: {m}")
    return lines


def _failure_lines(report: dict[str, Any]) -> list[str]:
    """The runs that did not finish, where any did (nothing otherwise)."""
    lines: list[str] = []
    failures = [(e["preset"], side, d) for e in report["rows"] for side, d in e["sides"].items()
                if e["hf_status"] != "none" and d.get("status") not in ("ok", None)]
    if failures:
        lines += ["", "## Runs that did not finish", ""]
        for name, side, d in failures:
            lines.append(f"- {name} / {side}: {d.get('status')}: {d.get('error')}")
    return lines


def _run_lines(report: dict[str, Any]) -> list[str]:
    """Every run, one line each."""
    lines: list[str] = []
    lines += ["", "## Every run", "", "| rep | preset | side | ran | step s median | p10 | p90 | peak MiB | val PPL | run wall s |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["runs"]:
        res = r["result"]
        st = res.get("step_time_s") or {}
        lines.append(f"| {r['rep']} | {r['preset']} | {r['side']} | {r['position']} | {num(st.get('median'))} "
                     f"| {num(st.get('p10'))} | {num(st.get('p90'))} | {mib((res.get('memory') or {}).get('peak_bytes'))} "
                     f"| {num(res.get('val_ppl'), '{:,.1f}')} | {num(res.get('process_wall_s'), '{:.0f}')} |")
    return lines


_SECTIONS = (_provenance_lines, _results_lines, _ratio_lines, _allocator_lines, _category_lines, _mapping_lines,
             _failure_lines, _run_lines)


def render_markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: provenance, values, ratios, breakdowns, mapping, raw runs."""
    lines = [line for section in _SECTIONS for line in section(report)]  # in reading order
    return "\n".join(lines) + "\n"


def _runner_environment(device: Any) -> dict[str, Any]:
    """What the report says produced it when no run recorded its own ``env`` (every run so far
    failed): ``runtime.env.environment``, except on CUDA, where that initialises CUDA in this
    process, which runs the rows' workers and would keep CUDA state beside them for the rest of the
    comparison; there the GPU's name comes from a child process (``bench.cuda_caps``)."""
    # on this side's turn: the package imports no torch before the lockstep baton
    import torch

    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import environment

    if device.type != "cuda":
        return environment(device)
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.bench.runner import hardware_name

    # The host's facts (software versions, commit, threads) as any result records them; the device's
    # from the child.
    name = hardware_name(device)
    return {**environment(torch.device("cpu")), "device": name, "device_model": name, "device_type": "cuda"}


def write_report(out: Path, rows: list[dict[str, Any]], settings: dict[str, Any], command: Optional[str],
                 start: float) -> dict[str, Any]:
    """Aggregate every recorded run of these rows; write JSON and Markdown; return the report."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.runtime.env import resolve_device

    hashes = {config_hash(r["config"]) for r in rows}
    runs = [r for r in read_runs(out) if r["config_hash"] in hashes]
    commands = ((out / COMMANDS_FILE).read_text().splitlines() if (out / COMMANDS_FILE).is_file()
                else [command] if command else [])
    wall = time.perf_counter() - start
    if command is None:  # --report-only: the runs' own wall time (a lockstep pair lasts as long as its longer side)
        command = commands[-1].split("  #")[0] if commands else None
        pairs: dict[tuple, list[float]] = {}
        for r in runs:
            pairs.setdefault((r["rep"], r["preset"], r.get("lockstep") and "pair" or r["side"]), []).append(
                r["result"].get("process_wall_s") or 0.0)
        wall = sum(max(v) for v in pairs.values())
    tf_version = next((r["result"].get("transformers") for r in runs if r["result"].get("transformers")), None)
    if tf_version is None:
        try:
            # on this side's turn: the package imports no torch before the lockstep baton
            import importlib.metadata as md

            tf_version = md.version("transformers")
        except Exception:  # noqa: BLE001
            tf_version = None
    report = {
        "command": command,
        "commands": commands,
        # The machine and commit of the runs themselves (a --report-only rebuild may come later).
        "env": next((r["result"]["env"] for r in runs if r["result"].get("env")), None)
        or _runner_environment(resolve_device(settings["device"])),
        "commits": sorted({str(r["result"]["env"].get("commit")) for r in runs if r["result"].get("env")}),
        "transformers": tf_version,
        "settings": settings,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": wall,
        "rows": aggregate(rows, runs),
        "configs": {r["preset"]: r["config"].to_dict() for r in rows},
        "runs": runs,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / REPORT_JSON, report)
    write_text_atomic(out / REPORT_MD, render_markdown(report))  # replaced whole, never written through a link
    return report


def _added(ckpt: dict[str, dict[str, float]], plain: dict[str, dict[str, float]], key: str) -> dict[str, float]:
    """Per operator, ``key`` (count or self_ms per step) of ``ckpt`` less that of ``plain``."""
    return {op: ckpt.get(op, {}).get(key, 0.0) - plain.get(op, {}).get(key, 0.0) for op in set(ckpt) | set(plain)}


def checkpointing_cost_lines(plain: dict[str, Any], ckpt: dict[str, Any], device_time: str, top: int = 10) -> list[str]:
    """What checkpointing adds to each side's step, from the profiles (:func:`profile_phases`) of a
    row without it (``plain``) and the same row with it (``ckpt``): phase times; the operators
    and kernels whose added calls per step differ between the sides (none: both run the same
    recompute); the operators with the most added self time (``device_time``: CUDA or CPU)."""
    lines = ["| side | forward | backward | optimizer | step | operator + kernel calls |", "|---|---:|---:|---:|---:|---:|"]
    calls, times = {}, {}
    for side in SIDES:
        calls[side] = _added(ckpt[side].get("ops", {}), plain[side].get("ops", {}), "count")
        times[side] = _added(ckpt[side].get("ops", {}), plain[side].get("ops", {}), "self_ms")
        lines.append(f"| {side} | " + " | ".join(f"{(ckpt[side][k] - plain[side][k]) * 1000:+.1f}" for k in
                                                  ("forward", "backward", "optimizer", "step"))
                     + f" | {sum(calls[side].values()):+.0f} |")
    ours, theirs = SIDES
    differ = sorted((op for op in set(calls[ours]) | set(calls[theirs])
                     if abs(calls[ours].get(op, 0.0) - calls[theirs].get(op, 0.0)) > 1e-9),
                    key=lambda op: -abs(calls[ours].get(op, 0.0) - calls[theirs].get(op, 0.0)))
    lines += ["", "Operators and kernels whose added calls per step differ between the sides:", ""]
    if differ:
        lines += [f"| operator | {ours} | {theirs} |", "|---|---:|---:|"]
        lines += [f"| `{op[:90]}` | {calls[ours].get(op, 0.0):+.1f} | {calls[theirs].get(op, 0.0):+.1f} |"
                  for op in differ[:top]]
    else:
        lines.append("none: each side adds the same calls of the same operators and kernels.")
    by_time = sorted(set(times[ours]) | set(times[theirs]),
                     key=lambda op: -max(times[ours].get(op, 0.0), times[theirs].get(op, 0.0)))
    lines += ["", f"Most added self {device_time} time per step (ms):", "",
              f"| operator | {ours} | {theirs} |", "|---|---:|---:|"]
    lines += [f"| `{op[:90]}` | {times[ours].get(op, 0.0):+.2f} | {times[theirs].get(op, 0.0):+.2f} |"
              for op in by_time[:top]]
    return lines


def _plain_twin(row: dict[str, Any], rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The row that is ``row`` without checkpointing (None: ``row`` has none, or no such row)."""
    tech = row["config"].technique
    if tech.checkpointing == "none":
        return None
    plain = dataclasses.replace(tech, checkpointing="none")
    return next((r for r in rows if r["config"].technique == plain), None)


def write_profiles(out: Path, rows: list[dict[str, Any]], steps: int, command: str) -> int:
    """``--profile``: per-phase medians of both sides for every row with a Trainer counterpart."""
    from memtrain.bench.hf.probe import profile_phases  # the step machinery (torch, transformers) only when profiling
    from memtrain.runtime.env import environment, git_commit, resolve_device

    env = environment(resolve_device(rows[0]["config"].train.device))
    lines = ["# Per-phase step times, memtrain vs the Trainer-equivalent step", "",
             f"- command: `{command}`", f"- commit: `{git_commit()}`; hardware: {hardware_text(env)}, "
             f"{env['host_threads']} torch threads", "",
             "Both steps in one process, alternating step by step; median milliseconds per phase "
             "(ours' phases are train_step's: forward includes the loss, optimizer includes clipping; "
             "the Trainer's: clipping is counted in its optimizer phase here too).", "",
             "Host syncs: reads of a device value by the host in one step's forward and backward "
             "(memtrain.metrics.host_syncs; on a GPU each drains the kernel queue).", "",
             "| preset | side | forward | backward | optimizer | step | host syncs |",
             "|---|---|---:|---:|---:|---:|---:|"]
    details = []
    profiled: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for row in rows:
        if row["plan"].status == "none":
            continue
        res = profile_phases(row["config"], steps)
        profiled.append((row, res))
        for side in SIDES:
            r = res[side]
            syncs = r["host_syncs"]["count"]
            lines.append(f"| {row['preset']} | {side} | " + " | ".join(f"{r[k] * 1000:.1f}" for k in
                         ("forward", "backward", "optimizer", "step")) + f" | {'-' if syncs is None else syncs} |")
            details += ["", f"### {row['preset']}: {side}", "", f"Host syncs: {r['host_syncs']['sites']}", "",
                        "```", r["top_ops"].rstrip(), "```"]
        print("\n".join(lines[-2:]), flush=True)
    device_time = "CUDA" if env.get("device_type") == "cuda" else "CPU"
    for row, res in profiled:
        twin = _plain_twin(row, [r for r, _ in profiled])
        if twin is not None:
            plain_res = next(r for t, r in profiled if t is twin)
            lines += ["", f"## What checkpointing adds, per side: {row['preset']} less {twin['preset']}", "",
                      "Milliseconds per step (medians) and calls per profiled step, the row with "
                      "checkpointing less the row without.", "",
                      *checkpointing_cost_lines(plain_res, res, device_time)]
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "profile.md", "\n".join(lines + ["", "## Top operators (3 steps)"] + details) + "\n")
    return 0

