"""Which files of a folder given by the user may be opened.

Opening a FIFO blocks until another process writes to it (a run that hangs forever), a
device or socket is no data at all, and a symbolic link can lead a read anywhere on the
machine. Model folders (``--model DIR``), dataset folders (``--data hf:DIR``) and sharded
checkpoints are read by memtrain *and* by libraries (transformers, datasets, torch's DCP
reader) that open whatever name they look for. So every file they may open is checked with
``lstat``/``stat`` first, which never blocks: only regular files inside the folder pass.

Imports only the standard library: the analytic commands reach it without torch.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Optional

__all__ = ["file_kind", "folder_entry_problems", "inside", "regular_file_problem", "special_file_kind", "stat_problem",
           "unknown_home", "visible_entries"]


def file_kind(mode: int) -> str:
    """'a FIFO', 'a socket', 'a directory' ... for an ``st_mode``."""
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "a special file"


def special_file_kind(path: Path) -> Optional[str]:
    """``file_kind`` of ``path`` (links followed) when it exists but is neither a regular file nor
    a directory, else None: what to say instead of "not found" about a FIFO, device or socket."""
    try:
        mode = path.stat().st_mode
    except OSError:  # missing, a dangling link, or not ours to read: the caller's "not found" stands
        return None
    return None if stat.S_ISREG(mode) or stat.S_ISDIR(mode) else file_kind(mode)


def inside(path: Path, roots: Iterable[Path]) -> bool:
    """Whether the resolved ``path`` lies in one of the (resolved) ``roots``."""
    return any(path == root or root in path.parents for root in roots)


def _link_target_problem(path: Path, roots: tuple[Path, ...]) -> Optional[str]:
    """None when the symbolic link ``path`` resolves inside ``roots``; else why not."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop (RuntimeError before Python 3.13)
        return "a symbolic link that leads nowhere (dangling or a loop)"
    if not inside(target, roots):
        return f"a symbolic link to {str(target)!r}, outside {str(roots[0])!r}"
    return None


# How a size-limit problem begins, so that a caller can give its own advice for a file too large
# to read whole (as models.source does) without matching the wording of every other problem.
TOO_LARGE = "larger than"


def regular_file_problem(path: Path, root: Path, link_roots: Iterable[Path] = (),
                         max_bytes: Optional[int] = None) -> Optional[str]:
    """None when ``path`` may be opened as a file of the folder ``root``; else why not, in words.

    ``path`` must be a regular file (a symbolic link to one is followed) that resolves inside
    ``root`` or one of ``link_roots`` (folders a link may lead into, e.g. a Hugging Face cache's
    ``blobs``), and, with ``max_bytes``, of at most that size (a small file its reader reads
    whole). Nothing is opened: ``lstat`` and ``stat`` never block on a FIFO.
    """
    roots = (root.resolve(), *(r.resolve() for r in link_roots))
    try:
        st = path.lstat()
    except OSError as exc:
        return f"unreadable ({exc.strerror or type(exc).__name__})"
    if stat.S_ISLNK(st.st_mode):
        why = _link_target_problem(path, roots)
        if why is not None:
            return why
        st = path.stat()
    elif not inside(path.parent.resolve() / path.name, roots):
        return f"outside {str(roots[0])!r}"
    return stat_problem(st, max_bytes)


def stat_problem(st: os.stat_result, max_bytes: Optional[int]) -> Optional[str]:
    """None when ``st`` is a regular file's of at most ``max_bytes``; else why not (the words
    every reader's line quotes)."""
    if not stat.S_ISREG(st.st_mode):
        return f"{file_kind(st.st_mode)}, not a regular file"
    if max_bytes is not None and st.st_size > max_bytes:
        return f"{TOO_LARGE} {max_bytes:,} bytes"
    return None


def folder_entry_problems(folder: Path, entries: Iterable[Path], link_roots: Iterable[Path] = (),
                          max_bytes: Callable[[Path], Optional[int]] = lambda entry: None,
                          ) -> Iterator[tuple[Path, str]]:
    """``(entry, why)`` for each entry of ``folder`` that may not be read: a folder (or a link to
    one inside ``folder``) passes, anything else must pass :func:`regular_file_problem`, with
    ``max_bytes(entry)`` as its size limit (a file its reader reads whole)."""
    roots = tuple(link_roots)
    for entry in entries:
        try:
            st = entry.lstat()
        except OSError as exc:
            yield entry, f"unreadable ({exc.strerror or type(exc).__name__})"
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        if stat.S_ISLNK(st.st_mode) and entry.is_dir():
            why = _link_target_problem(entry, (folder.resolve(), *(r.resolve() for r in roots)))
        else:
            why = regular_file_problem(entry, folder, roots, max_bytes(entry))
        if why is not None:
            yield entry, why


def visible_entries(folder: Path, recursive: bool) -> Iterator[Path]:
    """The entries of ``folder`` whose names do not start with a dot (hidden ones hold no model
    or dataset content: ``.git``, ``.cache``); with ``recursive``, those of its real (not linked)
    subfolders too. Sorted, so the first problem reported is the same on every run."""
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith("."):
            continue
        yield entry
        if recursive and entry.is_dir() and not entry.is_symlink():
            yield from visible_entries(entry, recursive)


def unknown_home(path: str, what: str) -> Optional[str]:
    """Why ``path`` (named ``what``, e.g. "--out") cannot be used, when it starts with the home
    folder of a user this system does not know (``~nouser/x``, or ``~`` with no home set); else
    None. pathlib's ``expanduser`` raised RuntimeError on one deep inside a run ("Could not
    determine home directory.", exit 1, naming no path); os.path's leaves it as it is."""
    if not path.startswith("~") or os.path.expanduser(path) != path:
        return None
    user = path[1:].split(os.sep, 1)[0]
    whose = f"user {user!r}" if user else "this user (HOME is not set)"
    return (f"{what} {path!r} starts with the home folder of {whose}, which this system does not know; "
            "give the full path")
