"""Results on disk: the names memtrain writes in an output folder, atomic files, and the append-only JSONL files.

The one place that writes and reads what a run produced, so the promises of
docs/reliability.md hold for every command alike:

- :func:`write_atomic` (and :func:`write_text_atomic`, :func:`write_json_atomic`): every file
  memtrain replaces (result.json, checkpoints, reports, plots) is written to a temporary file
  beside it, fsynced, then renamed onto its name with ``os.replace``: a reader sees the old
  file or the new one, never half of one, and a symbolic link (or a device, FIFO or folder)
  at the name is refused, never written through. JSON never holds ``NaN`` (non-finite floats
  become ``null``; ``json.dumps`` would otherwise write the invalid token). A failed write
  raises an OSError that names the file.
- temporary names are ``NAME.memtrain-<pid>.<random>.tmp``; :func:`remove_stale_temps` removes
  those whose writer is gone (a SIGKILL mid-save skips the writer's own cleanup) and nothing else.
- :func:`open_append` / :func:`open_new`: the files memtrain appends to or creates in an output
  folder (results.jsonl, metrics.jsonl, the lock) are opened with ``O_NOFOLLOW``; a symbolic
  link or a non-regular file there is refused.
- :func:`append_jsonl`: one row per line; when the file does not end with a newline (a
  previous append was killed or hit a full disk mid-line) a newline comes first, so the torn
  line stays alone and the new row is intact.
- :func:`read_jsonl`: every JSON object line; torn, non-UTF-8, non-object and hostile lines
  (nested deeper than MAX_JSON_DEPTH, an integer longer than MAX_INT_DIGITS, a non-finite
  number) are skipped and counted, never fatal (a caller decides whether to warn); a file over
  MAX_JSONL_FILE_BYTES is refused from its size.
- JSON text is parsed bounded and written strict by :mod:`memtrain.files.json_text`.
- the bench's ``results.jsonl`` store of rows is read and appended by :mod:`memtrain.files.bench_store`.
- the ``--out`` folder lock (``LOCK_NAME``) is taken and held by :mod:`memtrain.files.lock`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

# A leaf import (not memtrain.config.run), as in every module of memtrain.files: config reads its
# files through this package (config.file: files.json_text, files.guard), so files imports no config.
from memtrain.errors import ConfigError
from memtrain.files.json_file import JsonFileProblem, read_json_file
from memtrain.files.json_text import bounded_jsonl_lines, dumps, loads_bounded

LOCK_NAME = ".memtrain.lock"
# The bench store: one row per line, appended as each row finishes (see memtrain.bench).
BENCH_RESULTS = "results.jsonl"
# What each bench run into the folder was asked to run, written before its first row (memtrain.files.bench_record).
BENCH_RECORD = "bench_record.json"
RESULT_NAME = "result.json"  # memtrain train's result
METRICS_NAME = "metrics.jsonl"  # memtrain train's loss curve (memtrain.training.sinks)
REPORT_FILES = ("report.md", "report.csv", "report.json")  # memtrain.report
PLOT_FILES = ("peak_memory.png", "step_time.png", "max_batch.png", "memory_vs_time.png")  # memtrain.report.plots
# Every name memtrain writes in an output folder: none may be a link, and --save is none of them.
OUT_FILES = (RESULT_NAME, METRICS_NAME, LOCK_NAME, BENCH_RESULTS, BENCH_RECORD, *REPORT_FILES, *PLOT_FILES)
TRAIN_FILES = (RESULT_NAME, METRICS_NAME, LOCK_NAME)  # those memtrain train writes

# The largest JSON file memtrain reads back whole: a train's result.json and a sharded checkpoint's
# meta.json grow by about 20 bytes a step (their loss histories), so this is over ten million
# steps. A sparse 1 GiB one was read whole, as text, then parsed.
# Its readers look it up on this module at each call (``results.MAX_WHOLE_JSON_BYTES``), so that one
# setting bounds every reader of such a file.
MAX_WHOLE_JSON_BYTES = 256 << 20
# The largest JSON-lines file (a bench's results.jsonl, compare_hf's runs.jsonl) memtrain reads.
# A bench row is about 7 KB (the committed results: 8 rows in 52-70 KB), so this is some 4,500
# rows. Its lines are read in bounded pieces, but every byte was read and every row held: a
# sparse 8 GiB results.jsonl held `memtrain report` 47 s, and 30,000 rows of 840 bytes (25 MB)
# took 31 s and 470 MB. Looked up at each call, as MAX_WHOLE_JSON_BYTES is.
MAX_JSONL_FILE_BYTES = 32 << 20



def read_result(folder: str | Path) -> Optional[dict[str, Any]]:
    """The JSON object in ``FOLDER/result.json``, or None where there is none memtrain may read:
    absent, not a regular file of the folder (a FIFO, a link out), over MAX_WHOLE_JSON_BYTES, or
    not a JSON object. For readers that only ask what a run recorded; one that must refuse a bad
    file in its own words reads it itself."""
    path = Path(folder) / RESULT_NAME
    try:
        recorded = read_json_file(path, MAX_WHOLE_JSON_BYTES, root=path.parent)
    except JsonFileProblem:
        return None
    return recorded if isinstance(recorded, dict) else None

# --------------------------------------------------------------------------- safe writes
# NAME.memtrain-<pid>.<random>.tmp: the writer's pid tells a later run whether it is gone.
_TEMP_RE = re.compile(r"^(?P<name>.+)\.memtrain-(?P<pid>\d+)\.[A-Za-z0-9_]+\.tmp$")


def _temp_prefix(name: str) -> str:
    return f"{name}.memtrain-{os.getpid()}."


def longest_temp_name(name: str) -> str:
    """The longest name :func:`write_atomic`'s temporary file beside ``name`` can have: a pid of
    up to 7 digits (Linux's largest pid_max, 2**22) and mkstemp's 8 random characters. A name
    that fits the file system while this one does not failed only when the file was written,
    at the end of a run."""
    return f"{name}.memtrain-{'9' * 7}.{'x' * 8}.tmp"


def refuse_odd_destination(path: Path, what: str = "") -> None:
    """ConfigError when ``path``'s own name is a symbolic link or exists as anything but a
    regular file (a folder, device, FIFO, socket): memtrain writes only plain files of its own
    and never through a link, whoever planted it. A missing name is fine."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:  # e.g. a parent that is a file
        raise ConfigError(f"cannot write {what or str(path)!r}: {exc.strerror or exc}; choose another path") from None
    label = what or repr(str(path))
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"{label} is a symbolic link; memtrain does not write through links: remove it "
                          "or choose another path")
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file (a device, FIFO or socket)"
        raise ConfigError(f"{label} is {kind}; memtrain writes only regular files: choose another path")


def out_folder_problem(out: Path, writes: Iterable[str] = ()) -> Optional[str]:
    """Why a script cannot write into the folder ``out``, or None: a link or a file where the
    folder goes, or a link (anything but a plain file) under one of the names it ``writes``."""
    out = Path(out)
    if out.is_symlink():
        return f"--out {out} is a symbolic link; name a real folder"
    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a folder; name a folder"
    for name in writes:
        try:
            refuse_odd_destination(out / name, f"--out {out}: {name}")
        except ConfigError as exc:
            return str(exc)
    return None


def benchmark_out_problem(out: Path, produced: str) -> Optional[str]:
    """Why a benchmark script cannot write ``produced`` (a file name) into the folder ``out``, or
    None: :func:`out_folder_problem`, and a folder that already holds ``produced`` (the second
    run would replace the first one's figures, which a results folder's README may cite)."""
    out = Path(out)
    problem = out_folder_problem(out)
    if problem:
        return problem
    if os.path.lexists(out / produced):
        return f"--out {out} already holds {produced} from an earlier run; name another folder or move that one away"
    return None


def benchmark_file_problem(path: Path, flag: str = "--out") -> Optional[str]:
    """Why a benchmark script cannot write its table to the new file ``path``, or None: a link,
    a folder or another non-file there, or an existing file (an earlier run's table, which a
    results README may cite)."""
    path = Path(path)
    if path.is_symlink():
        return f"{flag} {path} is a symbolic link; name a new file"
    if path.is_dir():
        return f"{flag} {path} is a folder; name a new file"
    if os.path.lexists(path):
        return f"{flag} {path} already exists (an earlier run's table); name a new file or move that one away"
    return None


def named_write_error(exc: BaseException, path: Path) -> BaseException:
    """``exc`` as an error that names ``path``: an OSError gets it as its filename (the CLI's
    ``disk full writing PATH`` line); torch.save's RuntimeError ("file write failed", no errno)
    becomes OSError(ENOSPC) when the file system is nearly full, the likely cause."""
    if isinstance(exc, OSError) and not isinstance(exc, FileExistsError):
        return OSError(exc.errno, exc.strerror or str(exc), str(path))
    cause = exc.__context__
    if isinstance(exc, RuntimeError) and isinstance(cause, OSError) and cause.errno is not None:
        # torch.save into a Python file: the failed write's own error (ENOSPC, EFBIG, EDQUOT)
        return OSError(cause.errno, cause.strerror or str(cause), str(path))
    if isinstance(exc, RuntimeError) and "write failed" in str(exc):
        try:
            free = shutil.disk_usage(Path(path).parent).free
        except OSError:
            free = 0
        if free < 256 * 2**20:
            return OSError(errno.ENOSPC, "No space left on device", str(path))
    return exc


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (``/proc/self/status``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (the only portable read)
    os.umask(mask)
    return mask


def _destination_mode(path: Path) -> int:
    """The permission bits for a file written to ``path``: those of the regular file it replaces,
    else 0666 less the umask, as ``open`` creates files."""
    try:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    return 0o666 & ~umask()


def write_atomic(path: Path, write: Callable[[str], object], replace_link: bool = False) -> None:
    """Fill ``path`` through ``write(temp_path)`` and a rename: never a half-written file.

    The temporary file is created (exclusively) beside ``path``, so the rename stays on one
    file system; it is fsynced before the rename and removed on any failure, leaving what was
    at ``path`` untouched. ``os.replace`` replaces the name itself, so nothing a link at
    ``path`` points to is ever written; such a link is refused up front all the same, unless
    ``replace_link``: a run's own outputs, whose names were checked before its first step, so
    that a link there was planted during the run; refusing it then lost the whole run's result
    (or checkpoint), so the link is replaced, its target untouched, and a warning says so."""
    path = Path(path)
    if replace_link:
        drop_planted_link(path)
    refuse_odd_destination(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path.name), suffix=".tmp", dir=path.parent)
        try:
            # mkstemp makes the file owner-only (0600); the file it becomes gets the mode a plain
            # open would give (0666 less the umask), or keeps the mode of the file it replaces.
            os.fchmod(fd, _destination_mode(path))
        finally:
            os.close(fd)
    except OSError as exc:
        raise named_write_error(exc, path) from None
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace_link:
            drop_planted_link(path)
        refuse_odd_destination(path)  # planted while the file was being written
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, Exception):
            raise named_write_error(exc, path) from None
        raise


def write_text_atomic(path: Path, text: str, replace_link: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`write_atomic`). A file name that
    is not UTF-8 reaches Python as lone surrogates ("d\\udcff.txt"); such a path quoted in a
    report is written as that escape, so the file stays UTF-8 and the write cannot fail at the
    end of a bench (a strict encode lost the report)."""
    data = text.encode("utf-8", errors="backslashreplace")
    write_atomic(path, lambda tmp: Path(tmp).write_bytes(data), replace_link)


def write_json_atomic(path: Path, payload: Any, replace_link: bool = False) -> None:
    """Write JSON through a temporary file and a rename: never a half-written file
    (``replace_link``: see :func:`write_atomic`)."""
    text = dumps(payload, indent=2) + "\n"  # serialize first: a bad payload leaves nothing behind
    write_text_atomic(path, text, replace_link)


# Process ids are positive C ints: a pid read from a file name or a lock line outside them names
# no process (kill() raised OverflowError on one, and pid 0 would ask about our own group).
MAX_PID = 2**31 - 1


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (one we may not signal counts as alive)."""
    if not 0 < pid <= MAX_PID:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(folder: Path, name: Optional[str] = None) -> list[Path]:
    """Remove memtrain's temporary files in ``folder`` (only ``NAME.memtrain-<pid>.*.tmp``,
    for ``name`` when given) whose writing process no longer exists; return what was removed.
    A live writer's file, this process's own and every other file are left alone."""
    removed: list[Path] = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TEMP_RE.match(p.name)
        if m is None or (name is not None and m["name"] != name):
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or process_alive(pid):
            continue
        try:
            p.unlink()  # a link is removed itself, never its target
            removed.append(p)
        except OSError:
            pass
    return removed


def _open_regular(path: Path, flags: int) -> int:
    """``os.open`` with O_NOFOLLOW that accepts only a regular file; ConfigError otherwise."""
    refuse_odd_destination(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link planted since the check
            refuse_odd_destination(path)
        if isinstance(exc, FileExistsError):
            raise
        raise named_write_error(exc, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        refuse_odd_destination(path)
    os.set_blocking(fd, True)
    return fd


def open_append(path: Path) -> int:
    """A descriptor appending to ``path`` (created if missing; never through a link), after a
    newline when the file ends mid-line (a killed or failed append left a torn line: it stays
    alone and the next line is intact)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = _open_regular(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        if end > 0 and os.pread(fd, 1, end - 1) != b"\n":
            os.write(fd, b"\n")
    except OSError as exc:
        os.close(fd)
        raise named_write_error(exc, path) from None
    return fd


def open_new(path: Path, flag: str = "--out") -> int:
    """A descriptor of a new, empty ``path`` (O_EXCL: an existing file is never overwritten), open
    for reading too: a writer whose file is removed under it can still copy out what it wrote."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        return _open_regular(path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        raise ConfigError(f"{str(path)!r} already exists and is not overwritten; choose a new {flag} "
                          "(or continue that run with --resume)") from None


def write_all(fd: int, data: bytes, path: Path) -> None:
    """Write every byte of ``data`` to ``fd`` (os.write may write less); errors name ``path``."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        raise named_write_error(exc, path) from None


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one line, after a newline if the file ends mid-line; fsync it."""
    path = Path(path)
    line = (dumps(row) + "\n").encode()
    fd = open_append(path)
    try:
        write_all(fd, line, path)
        try:
            os.fsync(fd)
        except OSError as exc:
            raise named_write_error(exc, path) from None
    finally:
        os.close(fd)


@dataclass
class JsonlRead:
    """The object rows of a JSONL file and how many non-blank lines were not rows."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0


def iter_jsonl(path: Path) -> Iterator[Optional[dict[str, Any]]]:
    """Each non-blank line of ``path`` as it is read: its JSON object, or None for a line that is
    no row (torn, too long, not JSON, not an object); nothing for a missing file. A reader that
    folds the rows as they come (:func:`memtrain.files.bench_store.read_results_latest`) holds
    one at a time. ConfigError for a file over MAX_JSONL_FILE_BYTES, from its size, before a
    byte is read."""
    path = Path(path)
    if not path.is_file():
        return
    with open(path, "rb") as fh:
        size, limit = os.fstat(fh.fileno()).st_size, MAX_JSONL_FILE_BYTES
        if size > limit:
            raise ConfigError(f"{str(path)!r} is {size:,} bytes, more than memtrain reads of a results file "
                              f"({limit:,}, some 4,500 bench rows); move it aside or give another folder")
        for raw in bounded_jsonl_lines(fh):
            if raw is None:  # too long to be a row
                yield None
                continue
            raw = raw.strip()
            if not raw:
                continue
            try:
                value = loads_bounded(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                yield None
                continue
            yield value if isinstance(value, dict) else None


def read_jsonl(path: Path) -> JsonlRead:
    """Every JSON object line of ``path`` (missing file: none); other lines are counted.
    ConfigError for a file over MAX_JSONL_FILE_BYTES, from its size, before a byte is read."""
    read = JsonlRead()
    for value in iter_jsonl(path):
        if value is None:
            read.skipped += 1
        else:
            read.rows.append(value)
    return read


def read_checked_jsonl(path: Path, problem: Callable[[dict[str, Any]], Optional[str]]) -> JsonlRead:
    """The objects of the JSON-lines file ``path`` for which ``problem`` says None, and the count
    of lines that were not (torn, not a JSON object, or of the wrong shape: ``problem``'s text)."""
    read = read_jsonl(path)
    rows = [r for r in read.rows if problem(r) is None]
    return JsonlRead(rows=rows, skipped=read.skipped + len(read.rows) - len(rows))


def drop_planted_link(path: Path) -> None:
    """Remove a symbolic link at ``path`` (never its target), saying so: for the outputs of a
    command that checked their names before it started (a link was refused then), so that a link
    planted during the command does not make it refuse to write, and lose, what it produced."""
    path = Path(path)
    if path.is_symlink():
        sys.stderr.write(f"warning: {str(path)!r} became a symbolic link (to {os.readlink(path)!r}) while memtrain "
                         "ran; it is replaced by the file, its target left untouched\n")
        path.unlink(missing_ok=True)
