"""``python -m memtrain`` and the ``memtrain`` command (``run``, the console script's entry).

The entry is this small module, not ``memtrain.cli``, so that a signal arriving while the CLI's
modules import is handled: the console script used to import ``memtrain.cli`` first, and a Ctrl-C
then printed a traceback (exit 1, or a death by SIGINT), a SIGTERM ended the process with no line
(exit 143). ``cli.main`` installs its own handlers once it runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Optional

# SIGHUP (a terminal hung up) stops like SIGTERM. Spelled here, not imported from
# memtrain.runtime.signals: this module imports nothing of memtrain before its handlers are set.
STOPPING = (signal.SIGTERM, signal.SIGHUP)
INTERRUPTED = "error: interrupted; results written so far are kept\n"


def _interrupt(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # EBADF: closed
        return False
    return True


def reopen_closed_std_descriptors() -> None:
    """Point each of descriptors 0, 1 and 2 that was closed at start (`2>&-`, `<&-`, a daemon's
    launcher) at /dev/null. The system hands the lowest free descriptor to the next file opened:
    a checkpoint, metrics.jsonl or a lock then sat on descriptor 2 and took what a C library
    (OpenMP, a tokenizer) or a child process wrote to stderr. Inheritable, as standard
    descriptors are, so that a row or a rank started from here finds them too."""
    for fd in (0, 1, 2):
        if _is_open(fd):
            continue
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: fd, the lower ones being open
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)


def run(argv: Optional[list[str]] = None) -> int:
    """Import the CLI and run it, a Ctrl-C, SIGTERM or SIGHUP on the way being one line and exit 130.
    Not under torchrun (``WORLD_SIZE`` set), whose launcher owns its workers' signals, as
    ``cli.main`` does; not off the main thread, where Python allows no handler."""
    reopen_closed_std_descriptors()  # before anything opens a file
    guard = "WORLD_SIZE" not in os.environ and threading.current_thread() is threading.main_thread()
    before: dict[int, Any] = {sig: signal.getsignal(sig) for sig in STOPPING} if guard else {}
    try:
        for sig, handler in before.items():
            # A SIGHUP the process was started ignoring (nohup) stays ignored.
            if sig == signal.SIGTERM or handler is not signal.SIG_IGN:
                signal.signal(sig, _interrupt)
        from memtrain.cli import main  # after the handler: importing it takes most of the startup

        return main(argv)
    except KeyboardInterrupt:
        # A hung-up terminal answers EIO, a closed pipe EPIPE, and a stderr closed at start is
        # None (AttributeError): the line is lost, not a traceback.
        with contextlib.suppress(OSError, AttributeError):
            sys.stderr.write(INTERRUPTED)
            sys.stderr.flush()
        return 130
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(run())
