"""Results on disk: atomic JSON files, the append-only JSONL store, and the folder lock.

The one place that writes and reads what a run produced, so the promises of
docs/reliability.md hold for every command alike:

- :func:`write_json_atomic`: a temporary file, fsync, then ``os.replace``: a reader sees the
  old file or the new one, never half of one. Non-finite floats become ``null`` (JSON has no
  NaN; ``json.dumps`` would otherwise write the invalid token ``NaN``).
- :func:`append_jsonl`: one row per line; when the file does not end with a newline (a
  previous append was killed or hit a full disk mid-line) a newline comes first, so the torn
  line stays alone and the new row is intact.
- :func:`read_jsonl`: every JSON object line; torn, non-UTF-8 and non-object lines are
  skipped and counted, never fatal (a caller decides whether to warn).
- :func:`read_results_counted` / :func:`append_result` / :func:`select_rows`: the bench's
  ``results.jsonl`` store, read by the bench runner and by ``memtrain report`` alike.
- :class:`FolderLock`: ``fcntl.flock`` on a lock file inside an output folder; a second
  holder is refused at once with a :class:`~memtrain.config.ConfigError` (exit 2). The kernel
  drops the lock when its process dies, so a killed run never leaves the folder locked.
  Processes that write into the folder under the holder's lock (the ranks of a launched run)
  add themselves to the lock file (:func:`register_writer`); the folder stays refused while
  any of them lives, also after the holder died.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from memtrain.config import ConfigError

LOCK_NAME = ".memtrain.lock"
# The bench store: one row per line, appended as each row finishes (see memtrain.bench).
BENCH_RESULTS = "results.jsonl"


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
                value = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                read.skipped += 1
                continue
            if isinstance(value, dict):
                read.rows.append(value)
            else:
                read.skipped += 1
    return read


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


def _open_lock_file(path: Path, flag: str, folder: Path) -> Any:
    """The lock file opened for reading and writing (created when absent). Anything but a
    regular file there (a folder, a FIFO, a socket, a symbolic link) is refused: reading a FIFO
    would block, and a link would lock a file elsewhere."""
    refuse = ConfigError(f"{flag} {str(folder)!r}: {LOCK_NAME} there is not a regular file (a folder, pipe or "
                         "link); remove it, or choose another " + flag)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.EISDIR, errno.ELOOP, errno.ENXIO, errno.EOPNOTSUPP):
            raise refuse from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise refuse
    return os.fdopen(fd, "r+", errors="replace")


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
            fh = _open_lock_file(path, self.flag, self.folder)
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = (fh.read().strip().splitlines() or ["another process"])[0]
                fh.close()
                raise self._in_use(holder) from None
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
        live = _live_writers(fh.read())
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
        return ConfigError(f"{self.flag} {str(self.folder)!r} is in use by {holder}; wait for it to finish "
                           f"or choose another {self.flag}")

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


def _number_or_none(x: Any) -> bool:
    return x is None or _number(x)


_CONFIG_KEYS = {"model": ("d_model", "n_layers", "n_heads", "d_ff", "vocab_size"),
                "train": ("batch_size", "seq_len", "steps", "lr", "warmup_steps"),
                "data": ("data",)}


def bench_row_problem(row: dict[str, Any]) -> Optional[str]:
    """Why ``row`` cannot be a bench row the report can show, or None when it can.

    A hand-edited or foreign line that parses as JSON but has the wrong shape (a string where
    a number belongs, a list for the memory) is skipped like a torn line rather than crashing
    ``memtrain report`` halfway through its files."""
    if not isinstance(row.get("technique"), str) or not isinstance(row.get("status", ""), str):
        return "technique and status must be strings"
    if row.get("status") != "ok":
        return None
    config = row.get("config")
    if not isinstance(config, dict) or any(
            not isinstance(config.get(s), dict) or any(k not in config[s] for k in keys) for s, keys in _CONFIG_KEYS.items()):
        return "config lacks the model, train or data settings"
    memory, steps = row.get("memory"), row.get("step_time_s")
    if not isinstance(memory, dict) or not isinstance(steps, dict):
        return "memory and step_time_s must be objects"
    by_cat = memory.get("by_category")
    if by_cat is not None and (not isinstance(by_cat, dict) or not all(_number_or_none(v) for v in by_cat.values())):
        return "memory.by_category must map categories to numbers"
    numbers = [memory.get(k) for k in ("peak_bytes", "max_allocated_bytes", "max_reserved_bytes")]
    numbers += [steps.get(k) for k in ("median", "p10", "p90")]
    numbers += [row.get(k) for k in ("val_ppl", "tokens_per_s", "mfu", "total_time_s")]
    for part in ("max_batch", "estimate"):
        value = row.get(part)
        if value is not None and not isinstance(value, dict):
            return f"{part} must be an object"
        if isinstance(value, dict):
            numbers += [value.get(k) for k in ("batch_size", "budget_bytes", "peak_bytes")]
    if not all(_number_or_none(v) for v in numbers):
        return "a measured value is not a number"
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
