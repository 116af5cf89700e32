"""Results on disk: atomic JSON files, the append-only JSONL store, and the folder lock.

The one place that writes and reads what a run produced, so the promises of
docs/reliability.md hold for every command alike:

- :func:`write_json_atomic`: a temporary file, fsync, then ``os.replace``: a reader sees the
  old file or the new one, never half of one. Non-finite floats become ``null`` (JSON has no
  NaN; ``json.dumps`` would otherwise write the invalid token ``NaN``).
- :func:`append_jsonl`: one row per line; when the file does not end with a newline (a
  previous append was killed or hit a full disk mid-line) a newline comes first, so the torn
  line stays alone and the new row is intact.
- :func:`read_jsonl`: every JSON object line; torn, non-UTF-8, non-object and hostile lines
  (nested deeper than MAX_JSON_DEPTH, an integer longer than MAX_INT_DIGITS, a non-finite
  number) are skipped and counted, never fatal (a caller decides whether to warn).
- :func:`loads_bounded` / :func:`json_depth_error`: the bounded JSON parse every reader of
  JSON uses (results, config files, checkpoint metadata, JSON data files): the nesting is
  measured by a cheap scan before any parser recurses into it.
- :func:`read_results_counted` / :func:`append_result` / :func:`select_rows`: the bench's
  ``results.jsonl`` store, read by the bench runner and by ``memtrain report`` alike.
- :class:`FolderLock`: ``fcntl.flock`` on a lock file inside an output folder; a second
  holder is refused at once with a :class:`~memtrain.config.ConfigError` (exit 2). The kernel
  drops the lock when its process dies, so a killed run never leaves the folder locked.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

# A leaf import (not memtrain.config): config itself parses its files with loads_bounded.
from memtrain.errors import ConfigError

LOCK_NAME = ".memtrain.lock"
# The bench store: one row per line, appended as each row finishes (see memtrain.bench).
BENCH_RESULTS = "results.jsonl"


# --------------------------------------------------------------------------- bounded JSON
# Deeper nesting than this is refused before any parser sees it: Python's json and yaml
# recurse once per level (RecursionError near 1,000), pyarrow's JSON reader overflows the C
# stack (SIGSEGV) at about 20,000. Real records, configs and results nest a few levels.
MAX_JSON_DEPTH = 256
# Integers longer than this are refused: no count, size or seed memtrain reads comes near 30
# digits (2**64 has 20), while a 400-digit one overflows every float conversion downstream.
MAX_INT_DIGITS = 30
# Bytes handed to the depth scan at a time (a line longer than this is scanned in pieces).
SCAN_PIECE_BYTES = 1 << 20

# A complete JSON string (escapes included): removed before counting brackets.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
# Inside a string: everything up to (not including) its closing quote or a final lone backslash.
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)
# Outside a string: the next quote or bracket.
_STRUCTURE = re.compile(rb'["\[\]{}]')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")


class JsonDepthScan:
    """The running bracket depth of JSON text fed in pieces (bytes), strings skipped.

    Cheap: a piece whose strings all close inside it is handled by C-speed ``re.sub`` and
    ``bytes.count``; only brackets of a suspiciously deep piece, and the rare string that
    spans two pieces, are walked in Python. ``feed`` returns False once the depth has
    exceeded ``limit`` (the text is then refused, never parsed).
    """

    def __init__(self, limit: int = MAX_JSON_DEPTH) -> None:
        self.limit = limit
        self.depth = 0
        self.in_string = False
        self.escape = False  # the previous piece ended on a backslash inside a string

    def feed(self, piece: bytes) -> bool:
        if not self.in_string and not self.escape:
            outside = _JSON_STRING.sub(b"", piece)
            if b'"' not in outside:  # every string of the piece closed inside it
                return self._brackets(outside)
        return self._walk(piece)

    def _brackets(self, outside: bytes) -> bool:
        """Brackets outside strings: counted at once unless they could exceed the limit."""
        opens = outside.count(b"[") + outside.count(b"{")
        if self.depth + opens <= self.limit:
            self.depth = max(0, self.depth + opens - outside.count(b"]") - outside.count(b"}"))
            return True
        for c in outside.translate(None, _NOT_BRACKETS):
            self.depth = self.depth + 1 if c in _OPEN else max(0, self.depth - 1)
            if self.depth > self.limit:
                return False
        return True

    def _walk(self, piece: bytes) -> bool:
        """A piece in which a string opens or closes across the piece boundary."""
        pos, n = 0, len(piece)
        while pos < n:
            if self.escape:  # the escaped character itself
                self.escape, pos = False, pos + 1
            elif self.in_string:
                pos = _STRING_BODY.match(piece, pos).end()  # type: ignore[union-attr]  # matches the empty string
                if pos < n and piece[pos] == 0x5C:  # a lone backslash at the end of the piece
                    self.escape, pos = True, pos + 1
                elif pos < n:  # the closing quote
                    self.in_string, pos = False, pos + 1
            else:
                m = _STRUCTURE.search(piece, pos)
                if m is None:
                    break
                pos, c = m.end(), piece[m.start()]
                if c == 0x22:
                    self.in_string = True
                elif c in _OPEN:
                    self.depth += 1
                    if self.depth > self.limit:
                        return False
                else:
                    self.depth = max(0, self.depth - 1)
        return True


def json_depth_error(lines: Iterable[bytes], limit: int = MAX_JSON_DEPTH) -> Optional[int]:
    """The 1-based line at which JSON text (pieces of lines, as :func:`bounded_lines` gives
    them) nests deeper than ``limit``, or None when it never does."""
    scan = JsonDepthScan(limit)
    line = 1
    for piece in lines:
        if not scan.feed(piece):
            return line
        line += piece.endswith(b"\n")
    return None


def bounded_lines(fh: IO[bytes], piece: int = SCAN_PIECE_BYTES) -> Iterable[bytes]:
    """The lines of a binary file, a line longer than ``piece`` bytes in several pieces (only
    the last ends with a newline): memory stays bounded however long a line is."""
    while chunk := fh.readline(piece):
        yield chunk


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-')):,} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number JSON allows")


def loads_bounded(text: str | bytes, limit: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` for text memtrain did not necessarily write: ValueError (never a
    RecursionError, an overflow or a crash) when the text nests deeper than ``limit``, holds
    an integer longer than MAX_INT_DIGITS, or a number that is not finite (NaN, Infinity,
    1e999). Python's own json would recurse once per level and parse a 4,000-digit integer."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    too_deep = json_depth_error((raw[i:i + SCAN_PIECE_BYTES] for i in range(0, len(raw), SCAN_PIECE_BYTES)), limit)
    if too_deep is not None:
        raise ValueError(f"JSON nested deeper than {limit} levels (line {too_deep})")
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant)
    except RecursionError:  # the scan bounds the depth; kept for a parser's deeper internal recursion
        raise ValueError(f"JSON nested too deeply to parse (at most {limit} levels)") from None


def json_safe(value: Any) -> Any:
    """``value`` with every NaN/inf float replaced by None (recursively through dicts/lists)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(payload: Any, **kw: Any) -> str:
    """Strict JSON text of ``payload`` (non-finite floats as null; unknown objects as str)."""
    return json.dumps(json_safe(payload), allow_nan=False, default=str, **kw)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON through a temporary file and a rename: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(payload, indent=2) + "\n"  # serialize first: a bad payload leaves nothing behind
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one line, after a newline if the file ends mid-line; fsync it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (dumps(row) + "\n").encode()
    with open(path, "a+b") as fh:
        fh.seek(0, os.SEEK_END)
        if fh.tell() > 0:
            fh.seek(-1, os.SEEK_END)
            if fh.read(1) != b"\n":
                line = b"\n" + line  # a torn predecessor: keep it on its own line
        fh.seek(0, os.SEEK_END)
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


@dataclass
class JsonlRead:
    """The object rows of a JSONL file and how many non-blank lines were not rows."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def read_jsonl(path: Path) -> JsonlRead:
    """Every JSON object line of ``path`` (missing file: none); other lines are counted."""
    path = Path(path)
    read = JsonlRead()
    if not path.is_file():
        return read
    with open(path, "rb") as fh:
        for raw in fh:
            raw = raw.strip()
            if not raw:
                continue
            try:
                value = loads_bounded(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                read.skipped += 1
                continue
            if isinstance(value, dict):
                read.rows.append(value)
            else:
                read.skipped += 1
    return read


class FolderLock:
    """Exclusive use of an output folder while the ``with`` block runs.

    ``with FolderLock(out, "memtrain bench"):`` -- a second process asking for the same folder
    gets a ConfigError naming the holder's pid instead of interleaving its rows with ours.
    """

    def __init__(self, folder: Path, what: str = "memtrain", flag: str = "--out",
                 cleanup_if_unused: bool = False) -> None:
        self.folder = Path(folder)
        self.what = what
        self.flag = flag
        # A folder this lock created and nothing else wrote into is removed again on exit, so a
        # run refused after taking the lock leaves nothing behind (``train --out``).
        self.cleanup_if_unused = cleanup_if_unused
        self._created = False
        self._fh: Optional[Any] = None

    def __enter__(self) -> "FolderLock":
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_NAME
        while True:
            fh = open(path, "a+")
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                fh.close()
                raise ConfigError(f"{self.flag} {str(self.folder)!r} is in use by {holder}; wait for it to finish "
                                  f"or choose another {self.flag}") from None
            # A holder that cleaned up may have unlinked the file we opened: lock the file
            # that is there now, or two processes would each hold "the" lock.
            try:
                same = os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fh.close()
        fh.seek(0)
        fh.truncate()
        fh.write(f"{self.what} (pid {os.getpid()})\n")
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fh is None:
            return
        if self.cleanup_if_unused and self._created:
            try:
                if [p.name for p in self.folder.iterdir()] == [LOCK_NAME]:
                    (self.folder / LOCK_NAME).unlink()  # while still locked: see __enter__
                    self.folder.rmdir()
            except OSError:
                pass  # someone else's file appeared: keep the folder
        fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
        self._fh.close()
        self._fh = None


# --------------------------------------------------------------------------- bench rows
def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _measured(x: Any) -> bool:
    """A measured value: absent, or a finite number >= 0 (bytes, seconds, rates, losses)."""
    return x is None or (_number(x) and x >= 0)


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
}


def _config_problem(config: Any) -> Optional[str]:
    """Why a row's config cannot be read by the report, plan and bench, or None."""
    if not isinstance(config, dict) or any(
            not isinstance(config.get(s), dict) or any(k not in config[s] for k in keys) for s, keys in _CONFIG_KEYS.items()):
        return "config lacks the model, train or data settings"
    if not all(_number(config[s][k]) for s in ("model", "train") for k in _CONFIG_KEYS[s]):
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
    if row.get("status") != "ok":
        return None
    problem = _config_problem(row.get("config"))
    if problem is not None:
        return problem
    memory, steps = row.get("memory"), row.get("step_time_s")
    if not isinstance(memory, dict) or not isinstance(steps, dict):
        return "memory and step_time_s must be objects"
    by_cat = memory.get("by_category")
    if by_cat is not None and (not isinstance(by_cat, dict) or not all(_measured(v) for v in by_cat.values())):
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
    if not all(_measured(v) for v in numbers):
        return "a measured value is not a number >= 0"
    if any((row.get(k) or 0) > MAX_LOSS for k in ("val_loss", "train_loss")):
        return f"a loss above {MAX_LOSS:g} (no cross-entropy of a real vocabulary comes near it)"
    return None


# --------------------------------------------------------------------------- the bench store
def read_results_counted(out: Path) -> JsonlRead:
    """The bench rows of ``results.jsonl`` and the count of lines that were not rows (torn by
    a kill or a full disk, not a JSON object, or not shaped like a bench row)."""
    read = read_jsonl(Path(out) / BENCH_RESULTS)
    rows = [r for r in read.rows if bench_row_problem(r) is None]
    return JsonlRead(rows=rows, skipped=read.skipped + len(read.rows) - len(rows))


def read_results(out: Path) -> list[dict[str, Any]]:
    """All rows of ``results.jsonl``; torn and non-object lines are ignored."""
    return read_results_counted(out).rows


def append_result(out: Path, row: dict[str, Any]) -> None:
    """Append one row as one line (on a line of its own) and flush it to disk before going on."""
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
