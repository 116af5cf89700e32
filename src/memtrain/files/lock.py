"""The ``--out`` folder lock: exclusive use of an output folder (or of one file a run rewrites)
while a command writes into it.

:class:`FolderLock` is ``fcntl.flock`` on a lock file inside the folder; a second holder is
refused at once with a :class:`~memtrain.errors.ConfigError` (exit 2). The kernel drops the lock
when its process dies, so a killed run never leaves the folder locked. Processes that write into
the folder under the holder's lock (the ranks of a launched run) add themselves to the lock file
(:func:`register_writer`); the folder stays refused while any of them lives, also after the
holder died. :func:`file_lock` is the same lock for one file (``train --save``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import ConfigError
from memtrain.files.results import LOCK_NAME

# A writer's line in the lock file: "writer: WHAT (pid N, started T)". T tells the process from a
# later one that got the same pid (None off Linux, where only the pid is compared).
WRITER_PREFIX = "writer: "
_WRITER_LINE = re.compile(r"^writer: (?P<what>.*) \(pid (?P<pid>\d+), started (?P<started>\w+)\)$")


def process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started (Linux: ``/proc/PID/stat`` field 22, clock ticks after boot);
    None when it is gone or a zombie (it can write nothing more). Off Linux: "unknown" while
    ``kill(pid, 0)`` finds it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc here: the pid alone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "unknown"
    after_name = text[text.rfind(")") + 2:].split()  # the name may hold spaces and parentheses
    state, start = after_name[0], after_name[19]
    return None if state in ("Z", "X") else start


# What is read of a lock file: its holder's line and one per writer rank (tens of bytes each; the
# holder truncates the file when it takes it). A sparse 1 GiB lock file was read whole.
MAX_LOCK_CHARS = 1 << 20


def _live_writers(text: str) -> list[str]:
    """The writers listed in a lock file's ``text`` that still run (as "WHAT (pid N)")."""
    live = []
    for line in text.splitlines():
        m = _WRITER_LINE.match(line.strip())
        if not m or int(m["pid"]) == os.getpid():
            continue
        now = process_start(int(m["pid"]))
        if now is not None and (now == m["started"] or "unknown" in (now, m["started"])):
            live.append(f"{m['what']} (pid {m['pid']})")
    return live


def register_writer(folder: Path, what: str) -> None:
    """Add this process to the writers of ``folder``, whose lock another process holds (the
    launcher of this rank, or rank 0). A later :class:`FolderLock` on the folder is refused
    while this process lives, even when the holder is gone: a holder killed with SIGKILL frees
    its lock at once, and its ranks must not share the folder with a second run meanwhile."""
    line = f"{WRITER_PREFIX}{what} (pid {os.getpid()}, started {process_start(os.getpid()) or 'unknown'})\n"
    # O_APPEND: one write() per line, so the ranks' lines never overwrite each other.
    fd = os.open(Path(folder) / LOCK_NAME, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _lock_refusal(folder: Path, flag: str, mode: int, name: str = LOCK_NAME) -> ConfigError:
    """The one line for a lock file ``name`` that is not a regular file (of kind ``mode``)."""
    kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a FIFO, device or socket")
    return ConfigError(f"{flag} {str(folder)!r}: {name} there is not a regular file ({kind}); remove it, "
                       f"or choose another {flag}")


def check_lock_file(folder: Path, flag: str = "--out") -> None:
    """Refuse, before anything runs, a lock file that is not a regular file (see :func:`_open_lock_file`)."""
    try:
        mode = os.lstat(Path(folder) / LOCK_NAME).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise _lock_refusal(Path(folder), flag, mode)


def refuse_folder_in_use(folder: Path, what: str = "memtrain", flag: str = "--out") -> None:
    """Refuse, before the checks of what ``folder`` holds, a folder whose lock another process
    holds now: a second ``train`` on the folder of one still running was told the folder "already
    holds metrics.jsonl of an earlier run" and to continue it with --resume. Only tries the lock
    (never waits, creates or writes anything); the lock itself is still taken where the run starts."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return  # no lock file (or not one to open): the lock's own checks say so when it is taken
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return  # a folder or FIFO there: check_lock_file and the lock itself refuse it in their words
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 200).decode("utf-8", "replace")
            raise FolderLock(Path(folder), what, flag)._in_use((text.strip().splitlines() or ["another process"])[0]) \
                from None
        fcntl.flock(fd, fcntl.LOCK_UN)
        live = _live_writers(os.read(fd, MAX_LOCK_CHARS).decode("utf-8", "replace"))
    finally:
        os.close(fd)
    if live:  # the ranks of a launcher that died still write there
        raise FolderLock(Path(folder), what, flag)._in_use(live[0])


def _open_lock_file(path: Path, flag: str, folder: Path) -> Any:
    """The lock file opened for reading and writing (created when absent). Anything but a
    regular file there (a folder, a FIFO, a socket, a symbolic link) is refused: reading a FIFO
    would block, and a link would lock a file elsewhere."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
            raise _lock_refusal(folder, flag, os.lstat(path).st_mode, path.name) from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _lock_refusal(folder, flag, mode, path.name)
    return os.fdopen(fd, "r+", errors="replace")


class FolderLock:
    """Exclusive use of an output folder while the ``with`` block runs.

    ``with FolderLock(out, "memtrain bench"):`` -- a second process asking for the same folder
    gets a ConfigError naming the holder's pid instead of interleaving its rows with ours.
    """

    def __init__(self, folder: Path, what: str = "memtrain", flag: str = "--out",
                 cleanup_if_unused: bool = False, name: str = LOCK_NAME, subject: Optional[Path] = None) -> None:
        self.folder = Path(folder)
        self.what = what
        self.flag = flag
        # A folder this lock created and nothing else wrote into is removed again on exit, so a
        # run refused after taking the lock leaves nothing behind (``train --out``).
        self.cleanup_if_unused = cleanup_if_unused
        # The lock file's name in ``folder``, and what a refusal names (the folder, or one file
        # in it: :func:`file_lock`).
        self.name = name
        self.subject = Path(subject) if subject is not None else self.folder
        self._created = False
        self._fh: Optional[Any] = None

    def __enter__(self) -> "FolderLock":
        self._created = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / self.name
        while True:
            fh = _open_lock_file(path, self.flag, self.folder)
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = (fh.read(200).strip().splitlines() or ["another process"])[0]
                fh.close()
                raise self._in_use(holder) from None
            # A holder that cleaned up may have unlinked the file we opened: lock the file
            # that is there now, or two processes would each hold "the" lock.
            try:
                same = os.fstat(fh.fileno()).st_ino == os.lstat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fh.close()
        fh.seek(0)
        live = _live_writers(fh.read(MAX_LOCK_CHARS))
        if live:  # the holder is gone, its writers are not (e.g. the ranks of a killed launcher)
            fh.close()
            raise self._in_use(live[0])
        fh.seek(0)
        fh.truncate()
        fh.write(f"{self.what} (pid {os.getpid()})\n")
        fh.flush()
        self._fh = fh
        return self

    def _in_use(self, holder: str) -> ConfigError:
        return ConfigError(f"{self.flag} {str(self.subject)!r} is in use by {holder}; wait for it to finish "
                           f"or choose another {self.flag}")

    def __exit__(self, *exc: Any) -> None:
        if self._fh is None:
            return
        try:
            unused = self.cleanup_if_unused and self._created and [p.name for p in self.folder.iterdir()] == [self.name]
        except OSError:
            unused = False
        # A file's lock goes with the run; a folder's stays, as the mark of memtrain's folder,
        # unless the folder goes too. Removed while still held: see __enter__.
        if unused or self.name != LOCK_NAME:
            with contextlib.suppress(OSError):
                (self.folder / self.name).unlink()
        if unused:
            with contextlib.suppress(OSError):
                self.folder.rmdir()  # someone else's file appeared meanwhile: keep the folder
        fcntl.flock(self._fh.fileno(), fcntl.LOCK_UN)
        self._fh.close()
        self._fh = None


def file_lock(path: Path, what: str, flag: str) -> FolderLock:
    """Exclusive use of one file that a run rewrites (``train --save``) while the ``with`` block
    runs: two runs with different ``--out`` but one ``--save`` would each replace the other's
    checkpoint, and both succeed. The lock is a hidden file beside it, removed at the end, with
    the folder the lock made when nothing else was written there (a run refused before saving)."""
    path = Path(path)
    return FolderLock(path.parent, what, flag=flag, cleanup_if_unused=True, name=f".{path.name}{LOCK_NAME}",
                      subject=path)
