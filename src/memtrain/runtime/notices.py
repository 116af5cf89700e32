"""Warnings memtrain itself raises, how the CLI shows them, and when a progress bar may share
stderr with them (no torch import here, so the CLI can install the format before a command
loads anything heavy, and the torch-free plan can ask about its bar)."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Optional

# Defined in memtrain.errors (a leaf): models.auto_config warns with ConfigFieldWarning, and this
# module's random_base_warning reads models.spec, so a home here would close an import circle.
from memtrain.errors import ConfigFieldWarning, NoticeWarning

__all__ = ["ConfigFieldWarning", "NoticeWarning", "PartOfARecordWarning", "QLoRASkipWarning", "SlowPrecisionWarning", "install_warning_format", "random_base_warning",
           "ProgressLines", "shows_lines", "shows_progress"]


def shows_progress(requested: Optional[bool] = None) -> bool:
    """Whether a progress bar is drawn on stderr: ``requested`` (--progress / --no-progress)
    decides when given; unset (None), only when stderr is a terminal. A bar redraws its line
    with carriage returns: in a log or a captured stderr they stay, before an ``error:`` line
    or on it, so the refusal is no longer the one line a script reads."""
    if requested is not None:
        return requested
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # no stderr (None under pythonw), or a closed one
        return False


def shows_lines(requested: Optional[bool] = None) -> bool:
    """Whether plain progress lines (:class:`ProgressLines`) take the place of a bar: progress
    neither asked for nor refused (--progress / --no-progress unset) and stderr a file or a pipe,
    a log, not a terminal. A stream without a file descriptor (an in-process capture) is no log."""
    if requested is not None:
        return False
    try:
        return not os.isatty(sys.stderr.fileno())
    except (AttributeError, ValueError, OSError):  # no stderr, a closed one, or one with no descriptor
        return False


def _now() -> float:
    """The clock :class:`ProgressLines` reads (looked up at each use, so a test can set a fake one)."""
    return time.monotonic()


def _wait_for(stop: threading.Event, seconds: float) -> bool:
    """How :class:`ProgressLines`' heartbeat waits for its next line: until ``seconds`` pass
    (False) or the phase ends (True). Injectable, so a test moves a fake clock instead of waiting."""
    return stop.wait(seconds)


class ProgressLines:
    """Plain progress lines on a stderr that is no terminal, where no bar is drawn (a piped or
    nohup'd run printed nothing for ~25 s while it tokenized and trained, so its log showed no
    life). Nothing before ``first_after`` seconds of the phase (a quick run or a refusal stays
    silent: an ``error:`` line stays the one line a script reads), then one line at most every
    ``every`` seconds, and a closing line once any was written. Lines go to stderr: stdout's
    last line is what scripts parse. ``clock`` is injectable so a test need not wait.

    A piece of work that outlasts the cadence (one tokenizing batch, a first step that compiles)
    calls no :meth:`update` while it runs: a heartbeat thread (daemon, one per enabled phase)
    then writes a ``still running`` line at the same cadence, so a log never looks hung. One lock
    orders its lines with :meth:`update`'s, so no two lines interleave; :meth:`close` (the closing
    line) and :meth:`stop` (a phase that failed: no closing line) end it and wait for it, so
    nothing is written after the phase's last line. Used as a context manager, it stops on exit.
    ``wait`` (how the heartbeat waits, :func:`_wait_for`) is injectable with the clock."""

    def __init__(self, what: str, enabled: bool, total: Optional[int] = None, unit: str = "",
                 clock: Optional[Callable[[], float]] = None, first_after: float = 5.0, every: float = 30.0,
                 wait: Optional[Callable[[threading.Event, float], bool]] = None) -> None:
        self.what, self.enabled, self.total, self.unit = what, enabled, total, unit
        self.clock, self.first_after, self.every = clock or _now, first_after, every
        self.start = self.clock() if enabled else 0.0
        self.last: Optional[float] = None  # when the last line was written
        self.touched: Optional[float] = None  # when update() was last called: the work still moves
        self.done = 0
        self._lock = threading.Lock()  # one line at a time, from update() or the heartbeat
        self._ended = threading.Event()  # set by close() / stop(): no line after the phase's last
        self._wait = wait or _wait_for
        self._heartbeat: Optional[threading.Thread] = None
        if enabled:
            self._heartbeat = threading.Thread(target=self._beat_until_ended, name=f"memtrain {what} lines",
                                               daemon=True)  # daemon: never keeps a finished process alive
            self._heartbeat.start()

    def __enter__(self) -> "ProgressLines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _counted(self) -> str:
        of = f"/{self.total:,}" if self.total is not None else ""
        return f"{self.unit} {self.done:,}{of}" if self.unit == "step" else f"{self.done:,}{of} {self.unit}".rstrip()

    def _due(self, now: float) -> bool:
        """Whether a line may be written at ``now``: past the first seconds, and ``every``
        seconds after the last line."""
        return now - self.start >= self.first_after and (self.last is None or now - self.last >= self.every)

    def _heartbeat_due_at(self) -> float:
        """When the heartbeat writes its next line: where a line is due and :meth:`update` has not
        been called for ``every`` seconds (work that moves writes its own lines, with their
        detail; the heartbeat's took their place at every cadence of a steady run)."""
        line_due = self.start + self.first_after if self.last is None else self.last + self.every
        return line_due if self.touched is None else max(line_due, self.touched + self.every)

    def _seconds_to_next(self) -> float:
        """How long the heartbeat waits before it looks again: until its next line would be due."""
        return max(self._heartbeat_due_at() - self.clock(), 0.0)

    def update(self, done: int, detail: str = "") -> None:
        """``done`` units so far (a count, not an increment); a line when one is due."""
        self.done = done
        if not self.enabled:
            return
        with self._lock:
            now = self.touched = self.clock()
            if self._ended.is_set() or not self._due(now):
                return
            self.last = now
            extra = f", {detail}" if detail else ""
            self._write(f"{self.what}: {self._counted()} ({now - self.start:,.0f} s{extra})")

    def beat(self) -> None:
        """The heartbeat's line: where a line is due and no :meth:`update` came for ``every``
        seconds, a line saying the phase is still at work on what follows ``done``."""
        with self._lock:
            now = self.clock()
            if self._ended.is_set() or now < self._heartbeat_due_at():
                return
            self.last = now
            self._write(f"{self.what}: still running at {self._counted()} ({now - self.start:,.0f} s)")

    def _beat_until_ended(self) -> None:
        seconds = self.first_after  # the phase has just started: its first line is due this far on
        while not self._wait(self._ended, seconds):
            self.beat()
            seconds = self._seconds_to_next()

    def stop(self) -> None:
        """End the phase without its closing line (it failed, or was interrupted): the
        heartbeat stops, and is gone when this returns."""
        with self._lock:  # after a line being written, before the next
            self._ended.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join()
            self._heartbeat = None

    def close(self) -> None:
        """A line saying the phase ended, where a line said it was going on (none after
        :meth:`stop`); the heartbeat is gone before it is written."""
        stopped = self._ended.is_set()
        self.stop()
        if self.enabled and self.last is not None and not stopped:
            self._write(f"{self.what}: done, {self._counted()} in {self.clock() - self.start:,.0f} s")
            self.last = None

    @staticmethod
    def _write(line: str) -> None:
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (AttributeError, ValueError, OSError):  # no stderr, a closed one or a gone pipe: progress is no reason to fail
            pass


class SlowPrecisionWarning(NoticeWarning):
    """The run's precision has no native kernel on this device (slow matmuls)."""


class PartOfARecordWarning(NoticeWarning):
    """--text-field names one part of an instruction record (its prompt): the rest is not trained on."""


class QLoRASkipWarning(NoticeWarning):
    """--qlora leaves some frozen weights unquantized (their size does not fit NF4's blocks)."""


def install_warning_format() -> None:
    """Show a :class:`NoticeWarning` (memtrain's own, e.g. :class:`SlowPrecisionWarning`) on the
    terminal as one ``warning:`` line (the CLI's style) instead of Python's file:line form with
    the source line; other warnings keep their format."""
    original = warnings.formatwarning
    if getattr(original, "_memtrain", False):
        return

    def fmt(message: Any, category: type[Warning], filename: str, lineno: int, line: Optional[str] = None) -> str:
        if issubclass(category, NoticeWarning):
            return f"warning: {message}\n"
        return original(message, category, filename, lineno, line)

    fmt._memtrain = True  # type: ignore[attr-defined]
    warnings.formatwarning = fmt  # type: ignore[assignment]


def random_base_warning(cfg: Any) -> Optional[str]:
    """The warning for LoRA on randomly initialised base weights, or None.

    LoRA freezes the base and trains adapters on top of it: on a base nobody trained, the
    adapters learn around noise. A transformers --model without ``*.safetensors`` weights (a
    bundled config, a bare config.json) is built at random, and so is memtrain's GPT unless
    --resume loads trained weights. `memtrain train` says so once; the bench's LoRA row, which
    compares techniques on a GPT trained from scratch on purpose, does not call this.
    """
    tech, spec = cfg.technique, cfg.model.model
    if not tech.lora_rank or cfg.train.resume:
        return None
    from memtrain.models.source import resolve  # torch-free
    from memtrain.models.spec import is_gpt_preset  # torch-free

    if is_gpt_preset(spec):
        what = "memtrain's GPT starts from random weights (no --resume)"
    elif not resolve(spec).has_weights():
        what = f"--model {spec} has no *.safetensors weights, so its base is random"
    else:
        return None
    return (f"warning: --lora-rank {tech.lora_rank} on a random base: {what}; LoRA trains adapters on noise "
            "(drop --lora-rank to train every weight, or give a model with weights)")
