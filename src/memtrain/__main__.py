"""``python -m memtrain`` and the ``memtrain`` command (``run``, the console script's entry).

The entry is this small module, not ``memtrain.cli``, so that a signal arriving while the CLI's
modules import is handled: the console script used to import ``memtrain.cli`` first, and a Ctrl-C
then printed a traceback (exit 1, or a death by SIGINT), a SIGTERM ended the process with no line
(exit 143). ``cli.main`` installs its own handlers once it runs.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Optional

INTERRUPTED = "error: interrupted; results written so far are kept\n"


def _interrupt(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(argv: Optional[list[str]] = None) -> int:
    """Import the CLI and run it, a Ctrl-C or SIGTERM on the way being one line and exit 130.
    Not under torchrun (``WORLD_SIZE`` set), whose launcher owns its workers' signals, as
    ``cli.main`` does; not off the main thread, where Python allows no handler."""
    guard = "WORLD_SIZE" not in os.environ and threading.current_thread() is threading.main_thread()
    before: Any = signal.getsignal(signal.SIGTERM) if guard else None
    try:
        if guard:
            signal.signal(signal.SIGTERM, _interrupt)
        from memtrain.cli import main  # after the handler: importing it takes most of the startup

        return main(argv)
    except KeyboardInterrupt:
        sys.stderr.write(INTERRUPTED)
        return 130
    finally:
        if guard:
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(run())
