"""The bench's store of rows, ``OUT/results.jsonl``: what a row must hold to be read
(:func:`bench_row_problem`: a hand-edited or foreign line of the wrong shape is skipped like a
torn one), the store read and appended by the bench runner and by ``memtrain report`` and
``plan --results`` alike, and the grouping of rows by the settings they ran under
(:func:`row_settings`: a report compares only the rows of one settings).
"""

from __future__ import annotations

import math
import re
import stat
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import ConfigError
from memtrain.files.guard import file_kind
from memtrain.files.results import (
    BENCH_RESULTS,
    JsonlRead,
    append_jsonl,
    drop_planted_link,
    iter_jsonl,
    read_checked_jsonl,
)


def finite_number(x: Any) -> bool:
    """A JSON number (not a bool) that is finite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def measured_value(x: Any) -> bool:
    """A measured value: absent, or a finite number >= 0 (bytes, seconds, rates, losses)."""
    return x is None or (finite_number(x) and x >= 0)


# A cross-entropy loss in nats is at most ln(vocabulary) at the start of training (about 11 for
# GPT-2); a larger "loss" in a row is corrupt and would overflow exp() into the perplexity.
MAX_LOSS = 1000.0
_CONFIG_KEYS = {"model": ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size"),
                "train": ("batch_size", "seq_len", "steps", "lr", "warmup_steps"),
                "data": ("data",)}
# Optional parts of a row that readers index into (plan's numerics, the bench's resume key,
# the report's header): when present, each must have this type.
_OPTIONAL_TYPES: dict[str, type | tuple[type, ...]] = {
    "config_hash": str, "description": (str, type(None)), "env": dict, "device_caps": (dict, type(None)),
    "settings_hash": str, "max_batch_search": (dict, type(None)), "device_name": str,
    "data_fingerprint": str, "scale": (str, type(None)),
}


def _config_problem(config: Any) -> Optional[str]:
    """Why a row's config cannot be read by the report, plan and bench, or None."""
    if not isinstance(config, dict) or any(
            not isinstance(config.get(s), dict) or any(k not in config[s] for k in keys) for s, keys in _CONFIG_KEYS.items()):
        return "config lacks the model, train or data settings"
    if not all(finite_number(config[s][k]) for s in ("model", "train") for k in _CONFIG_KEYS[s]):
        return "a model or train setting in config is not a number"
    technique = config.get("technique", {})
    if not isinstance(config["data"]["data"], str) or not isinstance(technique, dict):
        return "config.data.data must be text and config.technique an object"
    if not all(isinstance(v, (str, int, float, bool, type(None))) for v in technique.values()):
        return "a technique setting in config is not a single value"
    return None


def bench_row_problem(row: dict[str, Any]) -> Optional[str]:
    """Why ``row`` cannot be a bench row the report can show, or None when it can.

    A hand-edited or foreign line that parses as JSON but has the wrong shape (a string where
    a number belongs, a list for the memory, a negative time) is skipped like a torn line
    rather than crashing ``memtrain report``, ``plan --results`` or a resumed bench."""
    if not isinstance(row.get("technique"), str) or not isinstance(row.get("status", ""), str):
        return "technique and status must be strings"
    for key, kind in _OPTIONAL_TYPES.items():
        if key in row and not isinstance(row[key], kind):
            return f"{key} has the wrong type"
    listed = row.get("bench_techniques", [])
    if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
        return "bench_techniques must be a list of names"
    if row.get("status") != "ok":
        return None
    problem = _config_problem(row.get("config"))
    if problem is not None:
        return problem
    memory, steps = row.get("memory"), row.get("step_time_s")
    if not isinstance(memory, dict) or not isinstance(steps, dict):
        return "memory and step_time_s must be objects"
    by_cat = memory.get("by_category")
    if by_cat is not None and (not isinstance(by_cat, dict) or not all(measured_value(v) for v in by_cat.values())):
        return "memory.by_category must map categories to numbers"
    numbers = [memory.get(k) for k in ("peak_bytes", "max_allocated_bytes", "max_reserved_bytes")]
    numbers += [steps.get(k) for k in ("median", "p10", "p90")]
    numbers += [row.get(k) for k in ("val_ppl", "val_loss", "train_loss", "tokens_per_s", "mfu", "total_time_s")]
    for part in ("max_batch", "estimate"):
        value = row.get(part)
        if value is not None and not isinstance(value, dict):
            return f"{part} must be an object"
        if isinstance(value, dict):
            numbers += [value.get(k) for k in ("batch_size", "budget_bytes", "peak_bytes")]
            probes = value.get("probes")
            if probes is not None and not (isinstance(probes, list) and all(isinstance(p, dict) for p in probes)):
                return f"{part}.probes must be a list of objects"
    if not all(measured_value(v) for v in numbers):
        return "a measured value is not a number >= 0"
    if any((row.get(k) or 0) > MAX_LOSS for k in ("val_loss", "train_loss")):
        return f"a loss above {MAX_LOSS:g} (no cross-entropy of a real vocabulary comes near it)"
    return None


def bench_results_file(folder: Path, reader: str) -> Path:
    """``folder``/results.jsonl, for a reader of a bench's results (``reader``: "memtrain report",
    "plan --results"), or one ConfigError, in the same words for every reader, saying what is
    there instead: nothing, a file where the folder goes, or a FIFO, device or folder where
    results.jsonl goes (found with ``stat``, never opened: a FIFO would block)."""
    path = Path(folder) / BENCH_RESULTS
    fix = f"{reader} takes a folder that memtrain bench wrote"
    try:
        mode = path.stat().st_mode
    except OSError:
        if Path(folder).exists() and not Path(folder).is_dir():
            raise ConfigError(f"{str(folder)!r} is {file_kind(Path(folder).stat().st_mode)}, not a folder; {fix}") from None
        missing = path if Path(folder).is_dir() else Path(folder)
        raise ConfigError(f"{str(missing)!r} not found; {fix}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{str(path)!r} is {file_kind(mode)}, not a file; {fix}")
    return path


def read_results_counted(out: Path) -> JsonlRead:
    """The bench rows of ``results.jsonl`` and the count of lines that were not rows (torn by
    a kill or a full disk, not a JSON object, or not shaped like a bench row)."""
    return read_checked_jsonl(Path(out) / BENCH_RESULTS, bench_row_problem)


def read_results_latest(out: Path) -> JsonlRead:
    """What a report reads of ``results.jsonl``: the rows streamed one at a time and folded, so
    that only the latest row of each technique under each settings is held (a folder appended
    to by many benches held every row: 30,000 rows took `memtrain report` 470 MB), and the
    count of lines that were not rows, as :func:`read_results_counted` counts them.

    The rows kept come in an order that gives :func:`latest_settings`, :func:`rows_under` with
    :func:`select_rows`, :func:`other_settings` and ``memtrain report --settings``' list the
    answers they give on every row: the settings groups by their last row's place in the file,
    and within a group each technique at the place it was first seen."""
    seen = 0  # the rows read so far: each row's place in the file
    latest: dict[str, dict[str, tuple[int, dict[str, Any]]]] = {}  # settings -> technique -> (first seen, row)
    last_place: dict[str, int] = {}  # settings -> its last row's place
    skipped = 0
    for row in iter_jsonl(Path(out) / BENCH_RESULTS):
        if row is None or bench_row_problem(row) is not None:
            skipped += 1
            continue
        sid, technique = row_settings(row), row["technique"]  # a string: bench_row_problem checked it
        group = latest.setdefault(sid, {})
        group[technique] = (group[technique][0] if technique in group else seen, row)
        last_place[sid] = seen
        seen += 1
    rows = [row for sid in sorted(latest, key=last_place.__getitem__)
            for _, row in sorted(latest[sid].values(), key=lambda placed: placed[0])]
    return JsonlRead(rows=rows, skipped=skipped)


def read_results(out: Path) -> list[dict[str, Any]]:
    """All rows of ``results.jsonl``; torn and non-object lines are ignored."""
    return read_results_counted(out).rows


def append_result(out: Path, row: dict[str, Any]) -> None:
    """Append one row as one line (on a line of its own) and flush it to disk before going on.
    The bench refused a link at results.jsonl before its first row: one there now was planted
    since, and is replaced rather than losing the row (:func:`drop_planted_link`)."""
    drop_planted_link(Path(out) / BENCH_RESULTS)
    append_jsonl(Path(out) / BENCH_RESULTS, row)


def select_rows(all_rows: list[dict[str, Any]], techniques: Optional[list[str]] = None) -> list[dict[str, Any]]:
    """The latest row per technique, in the order asked (or first-seen order)."""
    latest: dict[str, dict[str, Any]] = {}
    for r in all_rows:
        technique = r.get("technique", "?")
        if isinstance(technique, str):  # a hand-edited row with a non-string name is not a row of ours
            latest[technique] = r
    order = techniques or list(latest)
    return [latest[t] for t in order if t in latest]


def techniques_asked(rows: list[dict[str, Any]]) -> list[str]:
    """Every technique the benches of ``rows`` were asked to run (each row's ``bench_techniques``,
    its bench's whole list; rows written before it was recorded name none), in the order the
    benches listed them. Those with no row are what an interrupted bench left unfinished."""
    asked: dict[str, None] = {}
    for row in rows:
        asked.update(dict.fromkeys(row.get("bench_techniques") or []))
    return list(asked)


# The settings id of rows that record none (``settings_hash``): written before the bench recorded
# it, they cannot be told apart by their settings and are reported as one group.
UNRECORDED_SETTINGS = "unrecorded"


# What the bench writes as settings_hash (hex digits); anything else is a hand edit.
_SETTINGS_ID = re.compile(r"[0-9a-f]{1,64}")


def row_settings(row: dict[str, Any]) -> str:
    """The id of the settings a bench row ran under (what every row of its bench shared: the
    model, data and training settings, the max-batch search, the device, ...): its
    ``settings_hash``, or :data:`UNRECORDED_SETTINGS` (also for one that is not hex digits,
    which the report and an error line would otherwise print as given)."""
    value = row.get("settings_hash")
    return value if isinstance(value, str) and _SETTINGS_ID.fullmatch(value) else UNRECORDED_SETTINGS


def latest_settings(all_rows: list[dict[str, Any]]) -> Optional[str]:
    """The settings of the row appended last (None when there is none)."""
    return row_settings(all_rows[-1]) if all_rows else None


def rows_under(all_rows: list[dict[str, Any]], settings: Optional[str]) -> list[dict[str, Any]]:
    """The rows that ran under ``settings``, in file order."""
    return [r for r in all_rows if row_settings(r) == settings]


def other_settings(all_rows: list[dict[str, Any]], settings: Optional[str]) -> list[tuple[str, list[str]]]:
    """Every other settings id of ``all_rows`` with its techniques (the latest row of each), the
    group appended last first."""
    groups: dict[str, list[dict[str, Any]]] = {}
    last: dict[str, int] = {}
    for i, r in enumerate(all_rows):
        sid = row_settings(r)
        if sid != settings:
            groups.setdefault(sid, []).append(r)
            last[sid] = i
    newest_first = sorted(groups, key=last.__getitem__, reverse=True)
    return [(sid, [str(r.get("technique")) for r in select_rows(groups[sid])]) for sid in newest_first]
