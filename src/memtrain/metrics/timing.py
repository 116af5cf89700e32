"""Step timing: synchronize (or read device events), exclude warm-up, report the median and spread."""

from __future__ import annotations

import contextlib
import heapq
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["RunningMedian", "StepTimer", "TimingStats", "percentile", "synchronize"]


def synchronize(device: str | torch.device | None) -> None:
    """Wait for the device's queued work, so a wall-clock reading covers it.

    Kernels on CUDA (and MPS, XPU) run asynchronously: without this a step "ends" when its
    kernels are queued, not when they finish. CPU and meta need nothing.
    """
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.is_available():
            torch.cuda.synchronize(dev)
    elif dev.type == "mps":
        if torch.backends.mps.is_available():
            torch.mps.synchronize()
    elif dev.type == "xpu":
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            torch.xpu.synchronize(dev)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics.

    The same definition as ``numpy.percentile``'s default, so reported numbers match what a
    reader recomputes from the raw step times.
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class RunningMedian:
    """The median of the values added so far, kept as they come: ``percentile(values, 50)``
    after every ``add`` without sorting all of them again.

    The loop reports the timed-step median after every step (``train``'s ``on_step``); sorting
    the whole list each time cost O(n log n) a step, O(n² log n) a run, where n reaches the run's
    step count. Two heaps (the lower half as a max-heap of negated values, the upper half as a
    min-heap) make each ``add`` O(log n) and ``value`` O(1), the textbook streaming median.
    """

    def __init__(self) -> None:
        self._low: list[float] = []  # negated: heapq keeps min-heaps only
        self._high: list[float] = []

    def __len__(self) -> int:
        return len(self._low) + len(self._high)

    def add(self, x: float) -> None:
        # Into the lower half through the upper one, then rebalance: the lower half holds the
        # extra value when the count is odd.
        heapq.heappush(self._low, -heapq.heappushpop(self._high, x))
        if len(self._low) > len(self._high) + 1:
            heapq.heappush(self._high, -heapq.heappop(self._low))

    def value(self) -> float | None:
        """The median (the mean of the two middle values for an even count), None when empty."""
        if not self._low:
            return None
        if len(self._low) > len(self._high):
            return -self._low[0]
        lo, hi = -self._low[0], self._high[0]
        return lo + (hi - lo) * 0.5  # percentile()'s interpolation, to the last bit


@dataclass
class TimingStats:
    """Summary of the timed (post-warm-up) steps; times in seconds.

    ``data_wait_share`` is the time spent waiting for batches over that time plus the step
    time: the fraction of wall-clock the device would idle for lack of input. When the loop
    overlaps steps (``StepTimer(overlap=True)``) the host may wait for a batch while the device
    still runs the previous step, so the share is then an upper bound on the device's idling.

    ``device_idle_share`` measures that idling itself: the time between the end of one step and
    the start of the next on the device (data, logging, reading the loss, the next step's first
    launch) over that time plus the step time. Synchronized, the device idles for the whole
    host interval between two steps; overlapped, it is the device's own gap between the two
    steps' events, zero while the host keeps ahead. A step after an evaluation or a checkpoint
    (``StepTimer.skip_gap``) counts no gap: that time is work, not idling.
    """

    steps: int
    warmup_steps: int
    median: float | None
    p10: float | None
    p90: float | None
    mean: float | None
    min: float | None
    max: float | None
    total_s: float
    data_wait_s: float
    data_wait_share: float | None
    # The first step's own time, warm-up or not: where a compile, autotuning and the allocator's
    # first growth land (what "time to the first step" asks after the model is built).
    first_s: float | None = None
    device_idle_s: float = 0.0
    device_idle_share: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


class StepTimer:
    """Times training steps, leaving out the first ``warmup`` (allocator growth, autotuning,
    compilation), synchronizing the device around each step or, with ``overlap``, reading
    the device's own clock.

    Usage::

        timer = StepTimer(device, warmup=2)
        for _ in range(steps):
            with timer.data_wait():
                batch = next(batches)
            with timer.step():
                train_step(batch)
        print(timer.summary().median)

    Data wait recorded before a step belongs to that step; a warm-up step's wait is dropped
    with it. Times may also be fed directly with ``record`` (e.g. from another clock).

    ``overlap=True`` is for a loop that queues the next step before the current one has run
    (``memtrain.training.train`` on a GPU): nothing is synchronized. On CUDA each step is
    bracketed by two events on the current stream, and its time is the device's time between
    them: from when the device has both finished the previous step and been given this one's
    first kernel, to when it finishes this one's last. Gaps where the device waits for the host
    (data, logging) stay out of the step, as with synchronizing. Times are read when the events
    are done (``step_times`` reads those ready, ``summary`` waits for all). Elsewhere the
    marks are clock readings, which is what synchronizing gives on a CPU.

    Args:
        device: the device to synchronize before reading the clock (None: no sync).
        warmup: number of leading steps to leave out of the summary.
        clock: the time source, in seconds; ``time.perf_counter`` unless a test injects one.
        overlap: time with device events instead of synchronizing (see above).
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        warmup: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        overlap: bool = False,
    ) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.device = device
        self.warmup = warmup
        self.overlap = overlap
        self._clock = clock
        self._events = overlap and device is not None and torch.device(device).type == "cuda"
        self._seen = 0
        self._pending_wait = 0.0
        self._step_times: list[float] = []
        self._median = RunningMedian()  # of _step_times, kept per step (median_so_far)
        self.data_waits: list[float] = []
        self.first_step_s: float | None = None
        # overlap: (start mark, end mark, data wait, the previous step's end mark or None) per step
        self._unread: list[tuple[Any, Any, float, Any]] = []
        self._last_end: Any = None  # the last step's end mark (a clock reading when synchronizing)
        self.idle_gaps: list[float] = []  # per timed step: the device's idle time before it

    @property
    def step_times(self) -> list[float]:
        """The timed steps' times so far, in seconds (with ``overlap``: those the device has finished)."""
        self._read_marks(wait=False)
        return self._step_times

    def median_so_far(self) -> float | None:
        """The median of the timed steps so far (those the device has finished, with
        ``overlap``), None before the first; O(1) a call, for a per-step progress report."""
        self._read_marks(wait=False)
        return self._median.value()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the enclosed step, device work included."""
        if self.overlap:
            start = self._mark()
            yield
            end = self._mark()
            wait, self._pending_wait = self._pending_wait, 0.0
            self._unread.append((start, end, wait, self._last_end))
            self._last_end = end
            return
        synchronize(self.device)  # earlier queued work must not be billed to this step
        t0 = self._clock()
        gap = None if self._last_end is None else t0 - self._last_end
        yield
        synchronize(self.device)
        self._last_end = self._clock()
        self.record(self._last_end - t0, idle_s=gap)

    def skip_gap(self) -> None:
        """The time until the next step is work (an evaluation, a checkpoint), not idling."""
        self._last_end = None

    def _mark(self) -> Any:
        """A point in the step stream: a recorded CUDA event, or a clock reading."""
        if not self._events:
            return self._clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))  # the run's device, whichever is current
        return event

    def _read_marks(self, wait: bool) -> None:
        """Record the steps whose end mark is reached, in order (all of them when ``wait``)."""
        while self._unread:
            start, end, data_wait, previous = self._unread[0]
            if self._events:
                if not wait and not end.query():
                    return
                end.synchronize()
                seconds = start.elapsed_time(end) / 1000.0  # milliseconds between the events
                gap = None if previous is None else previous.elapsed_time(start) / 1000.0
            else:
                seconds = end - start
                gap = None if previous is None else start - previous
            self._unread.pop(0)
            self.record(seconds, data_wait, idle_s=gap)

    @contextlib.contextmanager
    def data_wait(self) -> Iterator[None]:
        """Time the enclosed wait for the next batch; it is attributed to the next step."""
        t0 = self._clock()
        yield
        self._pending_wait += self._clock() - t0

    def record(self, step_s: float, data_wait_s: float | None = None, idle_s: float | None = None) -> None:
        """Add one step's time (and its data wait; default: what ``data_wait`` accumulated;
        and the device's idle time before it, None when not measured)."""
        wait = self._pending_wait if data_wait_s is None else data_wait_s
        if data_wait_s is None:
            self._pending_wait = 0.0
        self._seen += 1
        if self._seen == 1:
            self.first_step_s = float(step_s)
        if self._seen <= self.warmup:
            return
        self._step_times.append(float(step_s))
        self._median.add(float(step_s))
        self.data_waits.append(float(wait))
        self.idle_gaps.append(max(0.0, float(idle_s)) if idle_s is not None else 0.0)

    def summary(self) -> TimingStats:
        """Median, 10th/90th percentile, mean, extremes and the data-wait share."""
        self._read_marks(wait=True)
        xs = self._step_times
        total = float(sum(xs))
        wait = float(sum(self.data_waits))
        idle = float(sum(self.idle_gaps))
        n = len(xs)
        return TimingStats(
            steps=n,
            warmup_steps=min(self._seen, self.warmup),
            median=percentile(xs, 50) if n else None,
            p10=percentile(xs, 10) if n else None,
            p90=percentile(xs, 90) if n else None,
            mean=total / n if n else None,
            min=min(xs) if n else None,
            max=max(xs) if n else None,
            total_s=total,
            data_wait_s=wait,
            data_wait_share=wait / (wait + total) if (wait + total) > 0 else None,
            first_s=self.first_step_s,
            device_idle_s=idle,
            device_idle_share=idle / (idle + total) if (idle + total) > 0 else None,
        )
