"""SIGTERM handled like Ctrl-C, so every exit path keeps what a run produced.

Python turns SIGINT into KeyboardInterrupt, and memtrain's commands already stop cleanly on
it (rows finished so far kept, a partial report written, exit 130). SIGTERM, which ``kill``,
job schedulers and container runtimes send, would otherwise end the process at once, skipping
every ``finally``: the row process and its scratch folder would be left behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block, SIGTERM raises KeyboardInterrupt (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
