"""The comparison's rows and what it records: one resolved config + Hugging Face plan per
row, one ``runs.jsonl`` line per side and repetition (the library's JSONL store and config
hash, so a row's identity means the same as in ``memtrain bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from memtrain.bench.hf.mapping import hf_plan, trainer_alignment
from memtrain.bench.runner import config_hash as bench_config_hash
from memtrain.bench.scales import fitted_scale_overrides
from memtrain.bench.technique_sets import technique_overrides
from memtrain.config.run import ConfigError, RunConfig, build_config, names_warmup, refuse_long_warmup
from memtrain.files.results import append_jsonl, read_jsonl

RUNS_FILE = "runs.jsonl"
COMMANDS_FILE = "commands.log"  # every invocation that wrote into the folder (--resume adds to runs.jsonl)
REPORT_JSON = "compare_hf.json"
REPORT_MD = "compare_hf.md"
SIDES = ("ours", "theirs")


def resolve_rows(scale: str, presets: list[str], overrides: dict[str, Any], device_type: str) -> list[dict[str, Any]]:
    """Each preset's memtrain config and Hugging Face plan, validated before anything runs.

    A preset takes :func:`mapping.trainer_alignment` (settings the Trainer cannot change,
    e.g. the low-bit optimizers' block) below the user's ``--set`` overrides."""
    rows = []
    for name in presets:
        try:
            row = technique_overrides(name, scale)
            layers = [fitted_scale_overrides(scale, row, overrides), row]
            align = trainer_alignment(build_config(*layers, overrides))
            cfg = build_config(*layers, align, overrides)
            if names_warmup(row, overrides):
                refuse_long_warmup(cfg.train)
        except ConfigError as exc:
            raise ConfigError(f"preset {name!r}: {exc}") from None
        plan = hf_plan(cfg, device_type)
        rows.append({"preset": name, "config": cfg, "plan": plan})
    return rows


def config_hash(cfg: RunConfig) -> str:
    """A row's identity: the bench's own hash of the resolved config (output folder ignored)."""
    return bench_config_hash(cfg.to_dict())


def read_runs(out: Path) -> list[dict[str, Any]]:
    """Every run line of ``OUT/runs.jsonl`` (torn lines from an interrupted write skipped)."""
    return read_jsonl(out / RUNS_FILE).rows


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
