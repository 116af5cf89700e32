"""One reader for a JSON file memtrain reads whole (a run's result.json, a token cache entry's
meta.json, a model's config.json, a saved dataset's state.json, a bench's bench_record.json): only
a regular file of at most a given size is opened, so a FIFO never blocks the reader and a huge or
sparse file is refused from its size, unread; then a bounded read (a file that grew since its
size was checked is read no further than its bound) and one parse. A link is followed, followed
into a given folder only, or refused (``follow_links=False``), as the caller says. Every problem is
a :class:`JsonFileProblem` that says why in words, for the caller to put in its own line (or to
skip the file)."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, Optional

from memtrain.files.guard import TOO_LARGE, regular_file_problem, stat_problem
from memtrain.files.json_text import loads_bounded

# What kind of problem a JsonFileProblem is, for a caller whose words differ by kind.
NOT_A_FILE, TOO_BIG, UNREADABLE, NOT_UTF8, NOT_JSON = "not a file", "too large", "unreadable", "not utf-8", "not json"
LINK = "a link"  # a symbolic link where follow_links=False refuses one
LINK_WORDS = "a symbolic link"

# Opened so that a FIFO swapped in after the stat check never blocks (O_NONBLOCK) and no child
# inherits the descriptor; O_NOFOLLOW is added where links are refused. getattr: not every
# platform has them.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class JsonFileProblem(ValueError):
    """Why a JSON file was not read (``str``: in words), which kind of problem it is (``kind``)
    and, for a file refused from its size, that size in bytes (``size``; else None)."""

    def __init__(self, why: str, kind: str, size: Optional[int] = None) -> None:
        super().__init__(why)
        self.kind = kind
        self.size = size


def read_json_file(path: Path, max_bytes: Optional[int], root: Optional[Path] = None, bounded: bool = True,
                   follow_links: bool = True) -> Any:
    """The JSON value in ``path``, read whole (any JSON value: the caller checks its shape).

    Checked with ``lstat``/``stat`` first (a FIFO, device or socket is never opened) and again on
    the open descriptor (a file swapped in since): a regular file of at most ``max_bytes`` (None:
    any size), read no further than that bound. Links, as ``follow_links`` and ``root`` say:
    ``follow_links`` True and no ``root``, a link is followed anywhere; with ``root``, only one
    that leads inside ``root`` (:func:`memtrain.files.guard.regular_file_problem`); ``follow_links``
    False, any link is refused (opened with O_NOFOLLOW: a link swapped in after the check is refused
    too), a problem of kind LINK. ``bounded``: memtrain's bounded parse
    (:func:`memtrain.files.json_text.loads_bounded`: nesting, integer length, non-finite numbers);
    False: Python's json on UTF-8 text (a tokenizer config's 31-digit integers), its RecursionError
    a problem too."""
    raw = _read_bounded(path, max_bytes, root, follow_links)
    try:
        return loads_bounded(raw) if bounded else json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise JsonFileProblem("not UTF-8 text", NOT_UTF8) from None
    except (ValueError, RecursionError) as exc:
        raise JsonFileProblem(f"not JSON ({type(exc).__name__})", NOT_JSON) from None


def _read_bounded(path: Path, max_bytes: Optional[int], root: Optional[Path], follow_links: bool) -> bytes:
    """The bytes of ``path`` under :func:`read_json_file`'s rules; JsonFileProblem for anything else."""
    if not follow_links and _is_link(path):
        raise JsonFileProblem(LINK_WORDS, LINK)
    _refuse(_path_problem(path, max_bytes, root, follow_links), path)
    flags = _OPEN_FLAGS if follow_links else _OPEN_FLAGS | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_links:  # a link swapped in after the lstat
            raise JsonFileProblem(LINK_WORDS, LINK) from None
        raise JsonFileProblem(f"unreadable ({exc.strerror or type(exc).__name__})", UNREADABLE) from None
    try:
        st = os.fstat(fd)
        _refuse(stat_problem(st, max_bytes), path, st.st_size)
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read() if max_bytes is None else fh.read(max_bytes + 1)
    except OSError as exc:  # a file not ours to read, or an I/O error: the reader's words say which
        raise JsonFileProblem(f"unreadable ({exc.strerror or type(exc).__name__})", UNREADABLE) from None
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:
        raise JsonFileProblem(f"grew past {max_bytes:,} bytes while read", TOO_BIG)
    return data


def _path_problem(path: Path, max_bytes: Optional[int], root: Optional[Path], follow_links: bool) -> Optional[str]:
    """Why ``path`` may not be opened, from ``lstat``/``stat`` alone (nothing is opened), or None.
    Not following links, ``path`` is no link (:func:`_is_link` came first)."""
    if follow_links and root is not None:
        return regular_file_problem(path, root, max_bytes=max_bytes)
    try:
        st = os.stat(path) if follow_links else os.lstat(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    return stat_problem(st, max_bytes)


def _is_link(path: Path) -> bool:
    """Whether ``path`` is a symbolic link (dangling or not)."""
    try:
        return stat.S_ISLNK(os.lstat(path).st_mode)
    except OSError:  # missing or not ours to stat: the open that follows says which
        return False


def _refuse(why: Optional[str], path: Path, size: Optional[int] = None) -> None:
    """Raise ``why`` as a JsonFileProblem of its kind (nothing when None); a size problem carries
    the file's size (``size``, or read with ``stat``, links followed as the check allowed)."""
    if why is None:
        return
    if why.startswith(TOO_LARGE):
        if size is None:
            try:
                size = os.stat(path).st_size
            except OSError:
                size = None
        raise JsonFileProblem(why, TOO_BIG, size)
    raise JsonFileProblem(why, UNREADABLE if why.startswith("unreadable") else NOT_A_FILE)
