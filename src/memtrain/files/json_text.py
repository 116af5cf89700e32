"""JSON text, read bounded and written strict: the parse every reader of JSON memtrain did not
necessarily write uses (results, config files, checkpoint metadata, JSON data files), and the
serialisation every JSON file memtrain writes goes through.

- :func:`loads_bounded` / :func:`json_depth_error`: the nesting is measured by a cheap scan
  (:class:`JsonDepthScan`) before any parser recurses into it; integers longer than
  MAX_INT_DIGITS and non-finite numbers are refused as ValueError, never a crash.
- :func:`bounded_lines` / :func:`bounded_jsonl_lines`: a file's lines in bounded pieces, and
  whole lines up to MAX_JSONL_LINE_BYTES (a longer one is read past, never held).
- :func:`dumps` / :func:`json_safe`: JSON never holds ``NaN`` (non-finite floats become
  ``null``; ``json.dumps`` would otherwise write the invalid token).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator
from typing import IO, Any, Callable, Optional

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


def counted_pieces(pieces: Iterable[bytes]) -> Iterator[tuple[bytes, int, int]]:
    """Each of ``pieces`` (of lines, as :func:`bounded_lines` gives them) with the bytes of its
    line so far, this piece's included, and the line's 1-based number: what a reader that skips
    a long line and one that refuses it both count."""
    size, line = 0, 1
    for piece in pieces:
        size += len(piece)
        yield piece, size, line
        if piece.endswith(b"\n"):
            size, line = 0, line + 1


# A JSON-lines line longer than this is skipped unread: a bench row is about 10 KB, and a line of
# 2 GB (a sparse or foreign results.jsonl) took `report` 6 GB of memory and 28 s to skip.
MAX_JSONL_LINE_BYTES = 16 << 20


def bounded_jsonl_lines(fh: IO[bytes], most: Optional[int] = None) -> Iterator[Optional[bytes]]:
    """Each line of a binary file, or None for one longer than ``most`` bytes
    (MAX_JSONL_LINE_BYTES), which is read past in pieces, never held whole."""
    most = MAX_JSONL_LINE_BYTES if most is None else most
    pieces: list[bytes] = []
    too_long = unfinished = False
    for piece, size, _ in counted_pieces(bounded_lines(fh)):
        too_long = too_long or size > most
        if too_long:
            pieces.clear()
        else:
            pieces.append(piece)
        unfinished = not piece.endswith(b"\n")
        if not unfinished:
            yield None if too_long else b"".join(pieces)
            pieces, too_long = [], False
    if unfinished:  # the last line, without its newline
        yield None if too_long else b"".join(pieces)


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


def loads_bounded(text: str | bytes, limit: int = MAX_JSON_DEPTH,
                  object_pairs_hook: Optional[Callable[[list[tuple[str, Any]]], Any]] = None) -> Any:
    """``json.loads`` for text memtrain did not necessarily write: ValueError (never a
    RecursionError, an overflow or a crash) when the text nests deeper than ``limit``, holds
    an integer longer than MAX_INT_DIGITS, or a number that is not finite (NaN, Infinity,
    1e999). Python's own json would recurse once per level and parse a 4,000-digit integer.
    ``object_pairs_hook`` is json's (a config file's reader refuses a key given twice with it)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    too_deep = json_depth_error((raw[i:i + SCAN_PIECE_BYTES] for i in range(0, len(raw), SCAN_PIECE_BYTES)), limit)
    if too_deep is not None:
        raise ValueError(f"JSON nested deeper than {limit} levels (line {too_deep})")
    try:
        return json.loads(text, parse_int=_bounded_int, parse_float=_finite_float, parse_constant=_no_constant,
                          object_pairs_hook=object_pairs_hook)
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
