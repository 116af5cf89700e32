"""One reader for a JSON file memtrain reads whole (a run's result.json, a token cache entry's
meta.json, a model's config.json, a saved dataset's state.json): only a regular file of at most a
given size is opened, so a FIFO never blocks the reader and a huge or sparse file is refused from
its size, unread; then one parse. Every problem is a :class:`JsonFileProblem` that says why in
words, for the caller to put in its own line (or to skip the file)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from memtrain.files.guard import TOO_LARGE, regular_file_problem, stat_problem
from memtrain.files.json_text import loads_bounded

# What kind of problem a JsonFileProblem is, for a caller whose words differ by kind.
NOT_A_FILE, TOO_BIG, UNREADABLE, NOT_UTF8, NOT_JSON = "not a file", "too large", "unreadable", "not utf-8", "not json"


class JsonFileProblem(ValueError):
    """Why a JSON file was not read (``str``: in words) and which kind of problem it is (``kind``)."""

    def __init__(self, why: str, kind: str) -> None:
        super().__init__(why)
        self.kind = kind


def read_json_file(path: Path, max_bytes: Optional[int], root: Optional[Path] = None, bounded: bool = True) -> Any:
    """The JSON value in ``path``, read whole.

    Checked with ``stat`` first (never ``open``): a regular file (a link followed; with ``root``,
    one that leads inside ``root`` only: :func:`memtrain.files.guard.regular_file_problem`) of at
    most ``max_bytes`` (None: any size). ``bounded``: memtrain's bounded parse
    (:func:`memtrain.files.json_text.loads_bounded`: nesting, integer length, non-finite numbers);
    False: Python's json on UTF-8 text (a tokenizer config's 31-digit integers), its RecursionError
    a problem too."""
    why = regular_file_problem(path, root, max_bytes=max_bytes) if root is not None else _file_problem(path, max_bytes)
    if why is not None:
        kind = TOO_BIG if why.startswith(TOO_LARGE) else UNREADABLE if why.startswith("unreadable") else NOT_A_FILE
        raise JsonFileProblem(why, kind)
    try:
        raw = path.read_bytes()
    except OSError as exc:  # a file that vanished or is not ours to read: the reader's words say which
        raise JsonFileProblem(f"unreadable ({exc.strerror or type(exc).__name__})", UNREADABLE) from None
    try:
        return loads_bounded(raw) if bounded else json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise JsonFileProblem("not UTF-8 text", NOT_UTF8) from None
    except (ValueError, RecursionError) as exc:
        raise JsonFileProblem(f"not JSON ({type(exc).__name__})", NOT_JSON) from None


def _file_problem(path: Path, max_bytes: Optional[int]) -> Optional[str]:
    """None when ``path`` (links followed) is a regular file of at most ``max_bytes``; else why not."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    return stat_problem(st, max_bytes)
