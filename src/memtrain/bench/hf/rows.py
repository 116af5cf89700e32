"""The comparison's rows and what it records: one resolved config + Hugging Face plan per
row, one ``runs.jsonl`` line per side and repetition (the library's JSONL store and config
hash, so a row's identity means the same as in ``memtrain bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memtrain.bench.hf.mapping import hf_plan, trainer_alignment
from memtrain.bench.runner import config_hash as bench_config_hash
from memtrain.bench.scales import row_base_layers
from memtrain.bench.technique_sets import technique_overrides
from memtrain.config.layers import normalized_layers, refuse_long_warmup, warmup_named
from memtrain.config.run import ConfigError, RunConfig, build_config
from memtrain.files.bench_store import finite_number, measured_value
from memtrain.files.results import JsonlRead, append_jsonl, read_checked_jsonl

RUNS_FILE = "runs.jsonl"
COMMANDS_FILE = "commands.log"  # every invocation that wrote into the folder (--resume adds to runs.jsonl)
REPORT_JSON = "compare_hf.json"
REPORT_MD = "compare_hf.md"
SIDES = ("ours", "theirs")


def resolve_rows(scale: str, presets: list[str], overrides: dict[str, Any], device_type: str) -> list[dict[str, Any]]:
    """Each preset's memtrain config and Hugging Face plan, validated before anything runs.

    A preset takes :func:`mapping.trainer_alignment` (settings the Trainer cannot change,
    e.g. the low-bit optimizers' block) below the user's ``--set`` overrides, and the model's
    default attention where neither names one (:func:`scales.row_base_layers`, as bench rows)."""
    rows = []
    for name in presets:
        try:
            row = technique_overrides(name, scale)
            flat_given = normalized_layers(row, overrides)  # read once: for the scale, the attention and the warm-up
            scale_layer, default_attention = row_base_layers(scale, flat_given)
            # The model's default attention as `memtrain bench` gives it (sdpa for a transformers
            # model, as the Trainer builds it), so both sides run what either tool runs unasked.
            layers = [scale_layer, row]
            align = trainer_alignment(build_config(*layers, overrides, default_attention))
            cfg = build_config(*layers, align, overrides, default_attention)
            if warmup_named(flat_given):
                refuse_long_warmup(cfg.train)
        except ConfigError as exc:
            raise ConfigError(f"preset {name!r}: {exc}") from None
        plan = hf_plan(cfg, device_type)
        rows.append({"preset": name, "config": cfg, "plan": plan})
    return rows


def config_hash(cfg: RunConfig) -> str:
    """A row's identity: the bench's own hash of the resolved config (output folder ignored)."""
    return bench_config_hash(cfg.to_dict())


def _ok_result_problem(res: dict[str, Any]) -> Optional[str]:
    """Why the result of an "ok" run cannot be aggregated by the report, or None."""
    steps, memory = res.get("step_time_s"), res.get("memory")
    if not isinstance(steps, dict) or not all(finite_number(steps.get(k)) and steps[k] > 0 for k in ("median", "p10", "p90")):
        return "step_time_s must hold positive median, p10 and p90"
    if not isinstance(memory, dict):
        return "memory must be an object"
    by_cat = memory.get("by_category")
    if by_cat is not None and (not isinstance(by_cat, dict) or not all(measured_value(v) for v in by_cat.values())):
        return "memory.by_category must map categories to numbers"
    numbers = [memory.get(k) for k in ("peak_bytes", "max_allocated_bytes", "max_reserved_bytes")]
    numbers += [res.get(k) for k in ("parameters", "trainable_parameters", "tokens_per_s", "total_time_s")]
    if not all(measured_value(v) for v in numbers) or not all(measured_value(res.get(k)) and res.get(k) is not None
                                                       for k in ("val_ppl", "train_loss")):
        return "a measured value is not a number >= 0"
    mb = res.get("max_batch")
    if mb is not None and (not isinstance(mb, dict) or not measured_value(mb.get("batch_size"))
                           or not measured_value(mb.get("peak_bytes"))
                           or not isinstance(mb.get("probes", []), list)
                           or not all(isinstance(p, dict) for p in mb.get("probes", []))):
        return "max_batch must be an object of numbers and a list of probes"
    windows = res.get("step_windows")
    if windows is not None and not (isinstance(windows, list) and all(
            isinstance(w, list) and len(w) == 2 and all(finite_number(t) for t in w) for w in windows)):
        return "step_windows must be a list of [start, end] times"
    return None


def run_line_problem(line: dict[str, Any]) -> Optional[str]:
    """Why a line of runs.jsonl cannot be a run the report and ``--resume`` read, or None: a
    hand-edited or foreign line that parses as JSON but has the wrong shape is skipped (and
    counted) like a torn one, rather than ending the comparison with a TypeError."""
    if not isinstance(line.get("preset"), str) or line.get("side") not in SIDES \
            or not isinstance(line.get("config_hash"), str):
        return "preset, side and config_hash must be text (side one of ours, theirs)"
    rep = line.get("rep")
    if not isinstance(rep, int) or isinstance(rep, bool) or rep < 0 or not isinstance(line.get("lockstep", False), bool):
        return "rep must be a count and lockstep true or false"
    res = line.get("result")
    if not isinstance(res, dict) or not isinstance(res.get("status", ""), str):
        return "result must be an object whose status is text"
    if not isinstance(res.get("error"), (str, type(None))) or not isinstance(res.get("env", {}), dict) \
            or not isinstance(res.get("transformers", ""), str) or not measured_value(res.get("process_wall_s")):
        return "error, env, transformers or process_wall_s has the wrong type"
    return _ok_result_problem(res) if res.get("status") == "ok" else None


def read_runs_counted(out: Path) -> JsonlRead:
    """The run lines of ``OUT/runs.jsonl`` and the count of lines that are not runs (torn by an
    interrupted write, not JSON objects, or not shaped like a run: :func:`run_line_problem`)."""
    return read_checked_jsonl(out / RUNS_FILE, run_line_problem)


def read_runs(out: Path) -> list[dict[str, Any]]:
    """Every run line of ``OUT/runs.jsonl`` (lines that are not runs skipped: :func:`read_runs_counted`)."""
    return read_runs_counted(out).rows


def append_run(out: Path, preset: str, side: str, rep: int, position: int, lockstep: bool, h: str,
               result: dict[str, Any]) -> dict[str, Any]:
    """Append one side's run as one line of ``OUT/runs.jsonl`` (flushed before going on)."""
    line = {"preset": preset, "side": side, "rep": rep, "position": position, "lockstep": lockstep,
            "config_hash": h, "result": _slim(result)}
    append_jsonl(out / RUNS_FILE, line)
    return line


def _slim(result: dict[str, Any]) -> dict[str, Any]:
    """What a run line keeps (the full config is in the report once per row)."""
    keep = ("status", "error", "train_loss", "val_loss", "val_ppl", "steps", "tokens", "step_time_s", "timed_steps",
            "total_time_s", "tokens_per_s", "memory", "parameters", "trainable_parameters", "max_batch",
            "loss_history", "worker_wall_s", "process_wall_s", "transformers", "env", "hf_plan", "lr_schedule", "step_windows")
    return {k: result[k] for k in keep if k in result}



def probe_at(max_batch: Optional[dict[str, Any]], batch: int) -> Optional[int]:
    for p in (max_batch or {}).get("probes", []):
        if p.get("batch_size") == batch:
            return p.get("peak_bytes")
    return None
