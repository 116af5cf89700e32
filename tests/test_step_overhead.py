"""What ``memtrain train``'s loop does per step beyond a plain PyTorch loop, counted, not timed.

On a GPU a small model's step lasts milliseconds, and the loop's own work between two steps is
time the device may wait (docs/performance.md, "Host work per step"). These tests count that
work on a CPU: the sorting behind the per-step progress median, and the tensor operations a
steady step runs beyond those of a plain loop over the same model (each one a kernel launch on a
GPU), captured with torch's dispatch mode.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from memtrain.config.run import build_config
from memtrain.metrics import timing
from memtrain.training import train as train_module


def test_the_per_step_median_is_not_sorted_anew_at_every_step(tiny_run, monkeypatch):
    """on_step's timed-step median (the bench's ETA) was percentile() of every timed step at
    every step: a sort of up to the run's step count, each step. It is now kept as steps are
    timed: no percentile during the loop, and the same median as the result's."""
    calls = [0]
    real = timing.percentile

    def counted(values: Any, q: float) -> float:
        calls[0] += 1
        return real(values, q)

    monkeypatch.setattr(timing, "percentile", counted)
    monkeypatch.setattr(train_module, "percentile", counted, raising=False)
    seen: list[tuple[int, Optional[float]]] = []

    def on_step(done: int, total: int, median: Optional[float]) -> None:
        seen.append((calls[0], median))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train_module.train(build_config({**tiny_run, "steps": 8}), on_step=on_step)
    assert len(seen) == 8
    assert {n for n, _ in seen} == {0}, seen  # not one percentile() call while stepping
    warmup = max(tiny_run["warmup_timing_steps"], len(train_module.METERED_STEPS))
    assert [m is None for _, m in seen] == [i < warmup for i in range(8)]
    assert seen[-1][1] == result["step_time_s"]["median"]
