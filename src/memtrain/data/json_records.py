"""Checks on JSON and JSON-lines data files before ``datasets``' json builder reads them: the
nesting is bounded (pyarrow's reader recurses in C and ends the process on a deep line), the
first record is an object (an array of numbers was read as a column named 'text'), and the
first line that is no record is named with its 1-based number (pyarrow counts rows from 0
within a block). Each refusal is one :class:`ConfigError` naming the file, the line and the fix.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

from memtrain.config.run import ConfigError
from memtrain.errors import first_line
from memtrain.files.json_text import MAX_JSON_DEPTH, bounded_lines, counted_pieces, json_depth_error, loads_bounded

PEEK_CHARS = 1 << 16  # enough to reach the first record of any file a person writes
# A .jsonl line longer than this is refused before any reader holds it: pyarrow and the check
# that names a bad line each hold a record whole, several times over (a 300 MiB line took 1.8 GB
# of memory before its refusal, and memory grows with the line).
MAX_JSON_RECORD_BYTES = 64 << 20
# datasets' json reader holds a .json array whole: it loads the array, then writes it again as
# JSON lines for pyarrow (a 64.6 MB array of 2 KB records peaked 409 MB above the reader's start,
# 6 times its size; the same records as JSON lines, read a chunk at a time, 112 MB). An array is
# one record to it, bounded by MAX_JSON_RECORD_BYTES as a line of JSON lines is.
JSON_ARRAY_PEEK_BYTES = 1 << 16  # enough to reach an array's "[" past any indentation a person writes


def _json_kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words (for a record that is not an object)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    for kind, types in (("string", str), ("array", list), ("object", dict)):
        if isinstance(value, types):
            return kind
    return "number"


def _not_json(exc: ValueError) -> str:
    """Why a line is not JSON, with its column (json's own "line 1" is the line itself)."""
    detail = f"{exc.msg} at column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else first_line(exc)
    return f"is not valid JSON ({detail})"


def check_json_records(files: list[Path]) -> None:
    """Refuse a JSON data file whose first record is not an object: datasets reads an array of
    numbers as a column it names 'text', so the refusal spoke of a field the file never had.
    (An array of strings stays what datasets makes of it: documents.) The first record is
    decoded, not judged by its first character: a line "nope" is not JSON, not a null."""
    for path in files:
        try:
            with path.open("r", encoding="utf-8-sig", errors="replace") as fh:
                head = fh.read(PEEK_CHARS).lstrip()
        except OSError as exc:
            raise ConfigError(f"cannot read {str(path)!r} ({exc.strerror or type(exc).__name__}); check --data") from None
        if path.suffix.lower() == ".json" and head.startswith("["):
            _check_first_element(path, head)
        elif head[:1] not in ("{", ""):
            _check_first_line(path)


def _check_first_element(path: Path, head: str) -> None:
    """Refuse a .json array whose first element (in ``head``, the file's start) is not a record."""
    first = head[1:].lstrip()
    if first[:1] in ("{", '"', "]", ""):
        return
    if first[:1] == "[":  # an array of arrays, whatever they hold (and however long the first is)
        kind = "array"
    else:  # a scalar: short, so the peek holds it whole
        try:
            kind = _json_kind(json.JSONDecoder().raw_decode(first)[0])
        except json.JSONDecodeError:
            return  # not JSON: datasets fails on it and first_bad_json_line names the line
    raise ConfigError(f"{str(path)!r} holds an array of JSON {kind}s, not records: write "
                      'each record as a JSON object with its text in a field, e.g. {"text": "..."}')


def _check_first_line(path: Path) -> None:
    """Refuse a JSON-lines file whose first record is not an object: not JSON at all (the line
    named, as a bad line further on is), or a JSON value of another kind."""
    try:
        with path.open("rb") as fh:
            number, line = next((n, text) for n, text in enumerate(fh, 1) if text.strip())
    except (OSError, StopIteration):
        return  # the nesting check read it; an empty file is left out before this
    try:
        record = loads_bounded(line)
    except ValueError as exc:
        raise ConfigError(f"cannot read {str(path)!r}: line {number} {_not_json(exc)}; fix that line or remove it") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{str(path)!r} line {number} holds a JSON {_json_kind(record)}, not a record: write each line "
                          'as a JSON object with its text in a field, e.g. {"text": "..."}')


def first_bad_json_line(files: list[Path], label: str) -> Optional[str]:
    """Where the first record Python's json module cannot read as an object is, 1-based:
    pyarrow's "in row N" behind datasets counts from 0 within its current block of the file,
    not the file's lines. None where every line reads (a .json array that spans lines)."""
    for path in files:
        try:
            with path.open("rb") as fh:
                for number, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = loads_bounded(line)
                    except ValueError as exc:  # the line alone: its column, not json's "line 1"
                        why = _not_json(exc)
                    else:
                        if isinstance(record, dict):
                            continue
                        why = f"holds a JSON {_json_kind(record)}, not a record (an object)"
                    where = f"line {number}" if str(path) == label else f"line {number} of {str(path)!r}"
                    return f"{where} {why}"
        except OSError:
            return None
    return None


def check_json_nesting(files: list[Path]) -> None:
    """Refuse JSON data nested deeper than MAX_JSON_DEPTH, naming the file and line.

    pyarrow's JSON reader (behind ``datasets``) recurses once per level in C: a line nested
    20,000 deep ends the process with SIGSEGV, no message and no cleanup; ``datasets`` itself
    raises RecursionError near 1,000 levels. One streaming pass (bounded pieces, strings
    skipped at C speed) measures the depth before either sees the file.
    """
    for path in files:
        try:
            whole = _read_whole(path)
            if whole:
                _check_array_size(path)
            with path.open("rb") as fh:
                pieces = bounded_lines(fh)
                if not whole:  # JSON lines (a .json file may hold them too): one record a line
                    pieces = _records_within(path, pieces)
                line = json_depth_error(pieces)
        except OSError as exc:
            raise ConfigError(f"cannot read {str(path)!r} ({exc.strerror or type(exc).__name__}); check --data") from None
        if line is not None:
            raise ConfigError(f"{str(path)!r} line {line}: JSON nested deeper than {MAX_JSON_DEPTH} levels; "
                              "flatten that record or remove it from the data")


def _read_whole(path: Path) -> bool:
    """Whether the json reader holds ``path`` whole: a .json file holding a JSON array. Any
    other JSON data file is read as JSON lines, a chunk of lines at a time."""
    if path.suffix.lower() != ".json":
        return False
    with path.open("rb") as fh:
        head = fh.read(JSON_ARRAY_PEEK_BYTES)
    return head.removeprefix(codecs.BOM_UTF8).lstrip()[:1] == b"["


def _check_array_size(path: Path) -> None:
    """Refuse a .json array larger than MAX_JSON_RECORD_BYTES from its size, before anything
    reads it: the json reader holds it whole, several times over."""
    size = path.stat().st_size
    if size > MAX_JSON_RECORD_BYTES:
        raise ConfigError(f"{str(path)!r} is a JSON array of {size:,} bytes, more than memtrain reads whole "
                          f"({MAX_JSON_RECORD_BYTES >> 20} MiB: its reader holds an array whole, several times over); "
                          "write it as JSON lines, one record a line, read a line at a time "
                          f"(e.g. jq -c '.[]' {path.name} > {path.stem}.jsonl)")


def _records_within(path: Path, pieces: Iterable[bytes]) -> Iterator[bytes]:
    """``pieces`` (of lines, as :func:`bounded_lines` gives them), refusing a line longer than
    MAX_JSON_RECORD_BYTES as soon as the count passes it."""
    for piece, size, line in counted_pieces(pieces):
        if size > MAX_JSON_RECORD_BYTES:
            raise ConfigError(f"{str(path)!r} line {line} is longer than {MAX_JSON_RECORD_BYTES >> 20} MiB, more than "
                              "memtrain reads as one record (its readers hold a record whole, several times over); "
                              "split it into records, or give the text as a .txt file (read in pieces)")
        yield piece
