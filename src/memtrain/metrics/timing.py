"""Step timing: synchronize, exclude warm-up, report the median and spread."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["StepTimer", "TimingStats", "percentile", "synchronize"]


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


@dataclass
class TimingStats:
    """Summary of the timed (post-warm-up) steps; times in seconds.

    ``data_wait_share`` is the time spent waiting for batches over that time plus the step
    time: the fraction of wall-clock the device would idle for lack of input.
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

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


class StepTimer:
    """Times training steps, leaving out the first ``warmup`` (allocator growth, autotuning,
    compilation) and synchronizing the device around each step.

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

    Args:
        device: the device to synchronize before reading the clock (None: no sync).
        warmup: number of leading steps to leave out of the summary.
        clock: the time source, in seconds; ``time.perf_counter`` unless a test injects one.
    """

    def __init__(
        self,
        device: str | torch.device | None = None,
        warmup: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        self.device = device
        self.warmup = warmup
        self._clock = clock
        self._seen = 0
        self._pending_wait = 0.0
        self.step_times: list[float] = []
        self.data_waits: list[float] = []
        self.first_step_s: float | None = None

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time the enclosed step, device work included."""
        synchronize(self.device)  # earlier queued work must not be billed to this step
        t0 = self._clock()
        yield
        synchronize(self.device)
        self.record(self._clock() - t0)

    @contextlib.contextmanager
    def data_wait(self) -> Iterator[None]:
        """Time the enclosed wait for the next batch; it is attributed to the next step."""
        t0 = self._clock()
        yield
        self._pending_wait += self._clock() - t0

    def record(self, step_s: float, data_wait_s: float | None = None) -> None:
        """Add one step's time (and its data wait; default: what ``data_wait`` accumulated)."""
        wait = self._pending_wait if data_wait_s is None else data_wait_s
        self._pending_wait = 0.0
        self._seen += 1
        if self._seen == 1:
            self.first_step_s = float(step_s)
        if self._seen <= self.warmup:
            return
        self.step_times.append(float(step_s))
        self.data_waits.append(float(wait))

    def summary(self) -> TimingStats:
        """Median, 10th/90th percentile, mean, extremes and the data-wait share."""
        xs = self.step_times
        total = float(sum(xs))
        wait = float(sum(self.data_waits))
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
        )
