"""The bench's record of what it was asked to run, ``OUT/bench_record.json``.

Each row appended to ``results.jsonl`` names its bench's whole list (``bench_techniques``), so a
report rebuilt from an interrupted bench names the rows it never finished. A bench interrupted
before it appended any row (its first rows were already done, so it skipped them) left nothing
saying what it was asked: this record, written before the first row runs, says it. It holds the
newest :data:`MAX_RECORDS` benches run into the folder, each with its planned rows, its settings
id (``settings_hash``, as its rows record it), its command line and when it started.

The file is replaced atomically (:func:`memtrain.files.results.write_json_atomic`) and read as
data only, bounded: a link, a file that is not regular, one over :data:`MAX_RECORD_BYTES`, one
that is not JSON or not of this shape is refused with one line of why (the caller warns and goes
on without it); an entry of the wrong shape is left out and counted.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

from memtrain.files import json_file
from memtrain.files.json_file import JsonFileProblem, read_json_file
from memtrain.files.json_text import dumps
from memtrain.files.results import BENCH_RECORD, write_json_atomic

RECORD_VERSION = 1
# The newest benches kept: a folder benched again and again keeps a bounded file.
MAX_RECORDS = 100
# A record is a few hundred bytes (a list of names and a command line): 100 of them fit in far
# less. Anything larger is not ours, and is refused from its size before a byte is read.
MAX_RECORD_BYTES = 1 << 20
MAX_TECHNIQUES = 256  # names in one bench's list (the default list has about ten)
MAX_NAME_CHARS = 512  # one name (key=value+key=value rows are the longest)
MAX_TEXT_CHARS = 4096  # the command line, the start time
_CUT = " ..."  # ends a command line cut to MAX_TEXT_CHARS
_SETTINGS_ID = re.compile(r"[0-9a-f]{1,64}")  # what the bench writes as settings_hash


@dataclass
class BenchRecords:
    """The benches recorded in a folder (oldest first) and, when the file or some of its entries
    could not be used, why (one line, for a warning). ``found``: the folder has a record file
    (False: a folder benched before the record existed)."""

    benches: list[dict[str, Any]] = field(default_factory=list)
    problem: Optional[str] = None
    found: bool = True


def new_record(techniques: list[str], settings: str, command: str) -> dict[str, Any]:
    """One bench's record: its planned rows, its settings id, its command line, its start (UTC)."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if len(command) > MAX_TEXT_CHARS:  # a list of hundreds of rows: its start says which bench it was
        command = command[:MAX_TEXT_CHARS - len(_CUT)] + _CUT
    return {"techniques": list(techniques), "settings_hash": settings, "command": command, "started": started}


def _text(value: Any, most: int = MAX_TEXT_CHARS) -> bool:
    return isinstance(value, str) and len(value) <= most


def record_problem(entry: Any) -> Optional[str]:
    """Why ``entry`` is not a bench record memtrain wrote, or None when it is."""
    if not isinstance(entry, dict):
        return "an entry is not an object"
    names = entry.get("techniques")
    if not isinstance(names, list) or len(names) > MAX_TECHNIQUES or not all(_text(n, MAX_NAME_CHARS) and n for n in names):
        return f"techniques must be a list of at most {MAX_TECHNIQUES} names of at most {MAX_NAME_CHARS} characters"
    sid = entry.get("settings_hash")
    if not isinstance(sid, str) or not _SETTINGS_ID.fullmatch(sid):
        return "settings_hash must be the hex id a bench writes"
    if not all(_text(entry.get(k)) for k in ("command", "started")):
        return "command and started must be text"
    return None


def _read_value(path: Path) -> Any:
    """The JSON value in ``path``, a regular file of at most MAX_RECORD_BYTES, read through the
    project's one bounded reader (:func:`memtrain.files.json_file.read_json_file`) with links
    refused: this file is never a link (opened with O_NOFOLLOW, so a link swapped in after the
    check is refused too), where the reader's other callers follow one that stays in their
    folder. ValueError in this record's words for anything else."""
    try:
        return read_json_file(path, MAX_RECORD_BYTES, follow_links=False)
    except JsonFileProblem as exc:
        raise ValueError(_problem_words(exc)) from None


def _problem_words(exc: JsonFileProblem) -> str:
    """Why the record was not read, as its warning says it (``it is ...``)."""
    if exc.kind == json_file.LINK:
        return "it is a symbolic link (memtrain reads no record through a link)"
    if exc.kind == json_file.TOO_BIG:
        if exc.size is None:  # it grew past the bound while read
            return f"it {exc}"
        return f"it is {exc.size:,} bytes, more than a bench record holds ({MAX_RECORD_BYTES:,})"
    if exc.kind == json_file.NOT_JSON:
        return "it is not JSON (torn by a kill, or edited)"
    if exc.kind == json_file.UNREADABLE:
        return str(exc)
    return f"it is {exc}"  # a FIFO, a directory ... "not a regular file"; "not UTF-8 text"


def _benches(value: Any) -> list[Any]:
    """The ``benches`` list of a record file's value; ValueError, in words, when it has none."""
    if not isinstance(value, dict) or not isinstance(value.get("benches"), list):
        raise ValueError('it is not an object with a "benches" list')
    if value.get("version") != RECORD_VERSION:
        raise ValueError(f"its version is {value.get('version')!r}, not {RECORD_VERSION}")
    return value["benches"]


def read_bench_records(out: Path) -> BenchRecords:
    """The benches recorded in ``out`` (none when there is no record: a folder of a bench from
    before the record, whose report names what its rows' ``bench_techniques`` name). Never raises
    for what the file holds: a problem is returned, in one line, for the caller to warn."""
    path = Path(out) / BENCH_RECORD
    if not os.path.lexists(path):
        return BenchRecords(found=False)
    try:
        entries = _benches(_read_value(path))
    except ValueError as exc:
        return BenchRecords(problem=f"{str(path)!r} was not read: {exc}")
    benches = [e for e in entries if record_problem(e) is None]
    if len(benches) == len(entries):
        return BenchRecords(benches=benches)
    first = next(p for p in map(record_problem, entries) if p is not None)
    return BenchRecords(benches=benches,
                        problem=f"{str(path)!r}: {len(entries) - len(benches)} entr(ies) of the wrong shape left out ({first})")


def record_bench(out: Path, record: dict[str, Any]) -> Optional[str]:
    """Add ``record`` to ``out``'s bench record (the newest MAX_RECORDS kept, fewer where they
    would not fit MAX_RECORD_BYTES) and replace the file atomically. Returns a line for the caller
    to warn with, or None: the earlier file was not read (it is replaced: what it held could not
    be used), or this bench's list is too large to record (nothing is written). A link planted
    since the bench checked its names is replaced, its target untouched (``replace_link``), as
    the bench's other files are."""
    path = Path(out) / BENCH_RECORD
    problem = record_problem(record)
    if problem is not None:
        return f"this bench is not recorded in {str(path)!r} ({problem})"
    earlier = read_bench_records(out)
    benches = (earlier.benches + [record])[-MAX_RECORDS:]
    # The oldest go first until the file is one its reader reads (long lists fill it sooner).
    while benches and len(dumps(_payload(benches), indent=2).encode()) + 1 > MAX_RECORD_BYTES:
        benches = benches[1:]
    if not benches:
        return f"this bench is not recorded in {str(path)!r} (its list is over {MAX_RECORD_BYTES:,} bytes)"
    write_json_atomic(path, _payload(benches), replace_link=True)
    return None if earlier.problem is None else f"{earlier.problem}; the file is rewritten with what could be read and this bench"


def _payload(benches: list[dict[str, Any]]) -> dict[str, Any]:
    return {"version": RECORD_VERSION, "benches": benches}


def techniques_recorded(benches: list[dict[str, Any]], settings: Optional[str]) -> list[str]:
    """Every technique the recorded benches that ran under ``settings`` were asked to run, in the
    order they listed them (each once)."""
    asked: dict[str, None] = {}
    for bench in benches:
        if bench["settings_hash"] == settings:
            asked.update(dict.fromkeys(bench["techniques"]))
    return list(asked)


def plans_no_row(records: BenchRecords) -> bool:
    """Whether a record file was read whole and names no planned row (no bench, or only benches
    with an empty list: a hand edit, since a bench records a list of at least one row)."""
    return records.found and records.problem is None and not any(b["techniques"] for b in records.benches)


@dataclass
class UnrunBench:
    """A bench settings id of the record that no row of results.jsonl ran under: its benches were
    interrupted before their first row was appended. ``techniques``: every row they planned (each
    once); ``started`` and ``command``: those of the newest of them."""

    settings: str
    techniques: list[str]
    started: str
    command: str


def unrun_benches(benches: list[dict[str, Any]], settings_with_rows: set[str]) -> list[UnrunBench]:
    """The recorded benches whose settings no row ran under (``settings_with_rows``: the settings
    ids of results.jsonl's rows), one per settings id, the newest first; benches that planned no
    row are left out."""
    newest: dict[str, dict[str, Any]] = {}
    for bench in benches:  # oldest first: the last one seen of each settings is its newest
        if bench["techniques"] and bench["settings_hash"] not in settings_with_rows:
            newest.pop(bench["settings_hash"], None)
            newest[bench["settings_hash"]] = bench
    return [UnrunBench(sid, techniques_recorded(benches, sid), bench["started"], bench["command"])
            for sid, bench in reversed(newest.items())]
