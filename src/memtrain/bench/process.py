"""Row processes that never outlive their bench, and scratch folders that never pile up.

- :func:`start_row` starts a row in its own process group (so Ctrl-C in a terminal reaches
  only the bench, which then stops the row cleanly, and torchrun's workers are stopped with
  it) and asks Linux to send it SIGTERM if the bench dies (``prctl(PR_SET_PDEATHSIG)``), so
  even a SIGKILL'd bench leaves no orphan training on.
- :func:`stop_row` stops the whole group: SIGTERM, a grace period, then SIGKILL; :func:`reap`
  waits for a process after an interrupt, where ``Popen.wait`` can block for ever.
- :func:`row_tmpdir` names scratch folders ``memtrain-row-<bench pid>-*``;
  :func:`clean_stale_row_dirs` removes those whose bench is gone (a SIGKILL skips every
  ``finally``), on the next run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from memtrain.files.results import process_alive
from memtrain.runtime.signals import PR_SET_PDEATHSIG

ROW_PREFIX = "memtrain-row-"


# Run by a small Python in front of the row command: ask the kernel for SIGTERM when the
# parent (the bench) dies, check the bench did not die already, then become the row command
# (the parent-death signal survives execv). Hand-written through ctypes: no library exposes
# prctl(PR_SET_PDEATHSIG). Done after exec rather than in a preexec_fn, which is unsafe in a
# process with threads (torch's), and inherited by torchrun's launcher, which stops its
# workers on SIGTERM.
_BIND_TO_PARENT = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(%d, signal.SIGTERM, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(143)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n" % PR_SET_PDEATHSIG
)


def start_row(cmd: Sequence[str], **kw: object) -> subprocess.Popen:
    """Start a row process in its own session, bound to live no longer than this process."""
    cmd = list(cmd)
    if sys.platform.startswith("linux"):  # elsewhere the process group alone lets the bench stop it
        cmd = [sys.executable, "-c", _BIND_TO_PARENT, str(os.getpid()), *cmd]
    return subprocess.Popen(cmd, start_new_session=True, **kw)  # type: ignore[call-overload]


def stop_row(proc: subprocess.Popen, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Stop ``proc`` and everything in its process group; wait for it."""
    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(proc.pid, s)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            reap(proc, timeout=grace_s if s != signal.SIGKILL else None)
            break
        except subprocess.TimeoutExpired:
            continue
    # The leader may be gone while a worker it started lingers in the group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reap(proc: subprocess.Popen, timeout: Optional[float] = None) -> None:
    """``proc.wait(timeout)`` without ``Popen``'s wait lock, for waits after an interrupt. ``stop_row``
    runs after a Ctrl-C or a SIGTERM raised KeyboardInterrupt inside the bench's own
    ``proc.wait(timeout=...)`` (or ``poll()``, ``communicate(timeout=...)``); CPython
    (3.11, 3.12) takes that lock just before the ``try`` that releases it, so an interrupt landing
    between the two leaves it held, and every later ``proc.wait()`` then blocks for ever (a bench
    stopped that way hung instead of exiting). Polling ``waitpid`` directly needs no lock."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while proc.returncode is None:
        try:  # without a timeout, one blocking waitpid
            pid, status = os.waitpid(proc.pid, os.WNOHANG if timeout is not None else 0)
        except ChildProcessError:  # nothing left to reap: recorded as Popen records it then
            proc.returncode = 0 if proc.returncode is None else proc.returncode
            return
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0.0)
        time.sleep(0.02)


def row_tmpdir() -> tempfile.TemporaryDirectory:
    """A scratch folder for one row, named after this bench's pid."""
    return tempfile.TemporaryDirectory(prefix=f"{ROW_PREFIX}{os.getpid()}-")


def clean_stale_row_dirs(root: Optional[Path] = None) -> int:
    """Remove ``memtrain-row-<pid>-*`` folders whose bench process no longer exists."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    for d in root.glob(ROW_PREFIX + "*"):
        pid_text = d.name[len(ROW_PREFIX):].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or process_alive(int(pid_text)):
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed += 1
    return removed
