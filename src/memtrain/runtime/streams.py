"""stdout and stderr that survive their reader going away.

A terminal that hung up (an ssh session closed, a terminal window shut) answers every write with
EIO; a pipe whose reader left (``memtrain bench | head -1``) with EPIPE. A print raising there
turned the end of a run into a traceback, or stopped it before it wrote its files (a bench's
partial report after SIGHUP, a train's progress line mid-run). Output no one can read any more
is dropped instead; everything the run writes to files goes on.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Any, Iterable, Iterator, TextIO

# The reader is gone: a hung-up terminal (EIO), a closed pipe (EPIPE), a descriptor closed
# (EBADF: the shell's `2>&-` under a wrapper script that left a read-only file there).
READER_GONE = frozenset({errno.EIO, errno.EPIPE, errno.EBADF})


class _Tolerant:
    """A text stream whose writes and flushes drop their text once its reader is gone. Its file
    descriptor is then pointed at /dev/null, so that Python's own flush at exit (and a child
    process inheriting it) meets no error either."""

    def __init__(self, stream: TextIO, any_error: bool = False) -> None:
        self._stream = stream
        # stderr holds diagnostics only: no failure to write them (a full disk under `2> log`)
        # may change how a run ends. stdout's other failures (a full disk under `> out.txt`) are
        # the user's output lost and still end the command with their line.
        self._any_error = any_error
        self.lost = False

    def _dropped(self, exc: OSError) -> bool:
        return self._any_error or exc.errno in READER_GONE

    def _gone(self) -> None:
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError):  # no descriptor (a test's capture)
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)

    def write(self, text: str) -> int:
        if self.lost:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            if not self._dropped(exc):
                raise
            self._gone()
            return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            if not self._dropped(exc):
                raise
            self._gone()
            # What the buffer still held now goes to /dev/null; the next flush (Python's at exit) is clean.
            with contextlib.suppress(OSError):
                self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self._stream, name)


@contextlib.contextmanager
def tolerant_std_streams() -> Iterator[None]:
    """Inside the block, sys.stdout and sys.stderr drop what they cannot deliver (:class:`_Tolerant`);
    at its end both are flushed through the wrappers and restored."""
    saved = sys.stdout, sys.stderr
    with contextlib.ExitStack() as closing:
        # Python leaves a stream None when its descriptor was closed at start (`2>&-`): the
        # error line's write then raised AttributeError, bad input exiting 1 instead of 2.
        nulls = [closing.enter_context(open(os.devnull, "w")) if s is None else s for s in saved]
        wrapped = _Tolerant(nulls[0]), _Tolerant(nulls[1], any_error=True)
        sys.stdout, sys.stderr = wrapped  # type: ignore[assignment]
        try:
            yield
        finally:
            for stream in wrapped:
                with contextlib.suppress(OSError, ValueError):  # ValueError: a stream closed by the caller
                    stream.flush()
            sys.stdout, sys.stderr = saved
