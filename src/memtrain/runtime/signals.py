"""SIGTERM and SIGHUP handled like Ctrl-C, so every exit path keeps what a run produced.

Python turns SIGINT into KeyboardInterrupt, and memtrain's commands already stop cleanly on
it (rows finished so far kept, a partial report written, exit 130). SIGTERM, which ``kill``,
job schedulers and container runtimes send, would otherwise end the process at once, skipping
every ``finally``: the row process and its scratch folder would be left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, Iterator

from memtrain.distributed.rank_errors import ERROR_DIR_ENV, LAUNCHED_ENV, launched_by_memtrain
from memtrain.errors import ConfigError
from memtrain.files.results import process_alive

# The signals that stop a command like Ctrl-C. SIGHUP (a terminal hung up, an ssh session closed)
# ended the process at once: no partial bench report, scratch left behind.
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

AGAIN_NOTE = ("warning: interrupted again; still stopping the run's processes and writing what it produced "
              "(interrupt once more to stop at once and lose that)\n")


class _Interrupts:
    """SIGINT and SIGTERM inside :func:`sigterm_as_interrupt`: the first raises KeyboardInterrupt;
    the cleanup it starts (a bench stopping its row and drawing its partial report, a run closing
    its loggers) then runs to its end. A second signal, which a scheduler's repeated SIGTERM or an
    impatient Ctrl-C sends within seconds, raised KeyboardInterrupt again mid-cleanup: a row left
    running without its SIGKILL, the plots not redrawn, a logger's buffered events not flushed.
    Now it is said once and waited out; a third one stops at once (the user insists)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 2:
            # os.write, not sys.stderr: the signal may have interrupted a write to sys.stderr, and
            # its buffered writer refuses a reentrant call.
            with contextlib.suppress(OSError):
                os.write(2, AGAIN_NOTE.encode())
            return
        raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM and SIGHUP raise KeyboardInterrupt like Ctrl-C (main thread only;
    else a no-op), and a second one lets the cleanup after the first finish (:class:`_Interrupts`).
    A SIGINT or SIGHUP the process was started ignoring (``nohup``, a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = _Interrupts()
    previous = {sig: signal.getsignal(sig) for sig in STOPPING}
    for sig, before in previous.items():
        if sig == signal.SIGTERM or before is not signal.SIG_IGN:
            signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before if before is not None else signal.SIG_DFL)


# ----------------------------------------------------------------------------- parent death
PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_PID_ENV = "MEMTRAIN_LAUNCHER_PID"  # set by memtrain.distributed.launch for the ranks it starts


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``).

    A torchrun rank runs in a session of its own (torch's launcher starts it so), so a launcher
    killed with SIGKILL, which cannot stop its ranks, would leave them training on as orphans,
    writing into a folder whose lock died with the launcher. With this, the kernel ends them
    with it. SIGKILL: a rank whose launcher is gone has no one to report to, and nothing may
    delay its end (a SIGTERM can be held back around a collective, memtrain.distributed.rank_errors).

    ``expected_parent``: the pid the parent had; a parent that died before the call (the
    signal then never comes) is caught by comparing it with ``os.getppid()`` right after, and
    the process ends at once. Returns whether the signal was set (False off Linux, where the
    launcher's process group is the only bond)."""

    if not sys.platform.startswith("linux"):
        return False
    parent = expected_parent if expected_parent is not None else os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl in this libc
        return False
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)
    return True


def bind_rank_to_launcher() -> bool:
    """In a process that torch's elastic launcher started (memtrain's ``--nproc-per-node`` or
    plain torchrun), :func:`die_with_parent`; elsewhere nothing. The launcher's pid comes from
    ``MEMTRAIN_LAUNCHER_PID`` under memtrain's launcher (so even a launcher that died before
    this call is noticed), else it is the parent now. Launch variables that are not this
    launch's raise ConfigError (:func:`stated_launcher`)."""

    if "TORCHELASTIC_RUN_ID" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    return die_with_parent(stated_launcher() if launched_by_memtrain() else None)


def stated_launcher() -> int | None:
    """The launcher pid ``MEMTRAIN_LAUNCHER_PID`` names, when it is this rank's launcher: our
    parent, or one that died and left its error folder (``MEMTRAIN_ERROR_DIR``, which its exit
    removes) behind; None when unset. memtrain's own variables set by mistake (exported from a
    shell that once ran a launcher, then plain torchrun) made every rank SIGKILL itself at start,
    exit 137 and no word: a pid that is not a number, or names a live process that is not our
    parent, or a dead one without that folder, is a ConfigError saying to unset them."""
    raw = os.environ.get(LAUNCHER_PID_ENV, "")
    if not raw:
        return None
    if raw.isdigit():
        pid = int(raw)
        folder = os.environ.get(ERROR_DIR_ENV, "")
        launcher_died = not process_alive(pid) and bool(folder) and os.path.isdir(folder)
        if pid == os.getppid() or launcher_died:
            return pid
    raise ConfigError(f"{LAUNCHED_ENV}=1 and {LAUNCHER_PID_ENV}={raw!r} are set, but memtrain's launcher did not "
                      f"start this process (pid {raw} is not its parent); unset {LAUNCHED_ENV}, {LAUNCHER_PID_ENV} "
                      f"and {ERROR_DIR_ENV}: `memtrain train --nproc-per-node N` sets them for its ranks")


class TimeLimitExceeded(Exception):
    """Raised inside :func:`time_limit`'s block when its time is up."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`TimeLimitExceeded` inside the block once ``seconds`` of wall time have passed
    (``SIGALRM``; main thread only, else no limit). For Python code of unknown cost that a file
    supplies (a model folder's chat template): the exception comes between two bytecodes, so a
    single long C call ends first. The previous handler and timer are restored on leaving."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise TimeLimitExceeded(f"{seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    # The process's one real-time timer: an outer one (an embedding program's, pytest-timeout's) is
    # re-armed with what it had left when the block ends, so this limit does not cancel it.
    outer_left, outer_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 1e-3), outer_interval)
