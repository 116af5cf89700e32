"""Per-row and whole-bench ETA, printed once per row after its first timed step.

Each row's worker writes a small heartbeat file once, after its first timed step (steps done,
steps in all, the timed-step time so far; ``memtrain.bench.worker.heartbeat_writer``). Once a row has a
timed step, the row's remaining training time is (steps left x median step); what a row spends
outside training (start-up, evaluation, the max-batch search, the estimate) is taken from the
rows already finished in this bench (their wall time minus their training time), and rows not
yet started are assumed to take as long as the finished ones on average (or this row's own
estimate while none has finished, the row's and the bench's figures then saying that they leave
out evaluation and the max-batch search). An estimate, said to be one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

__all__ = ["BenchEta", "fmt_duration"]


def fmt_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    m, s = divmod(int(round(seconds)), 60)
    if m < 60:
        return f"{m}m{s:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m"


class BenchEta:
    """Tracks the rows of one bench invocation (rows skipped as already done do not count)."""

    def __init__(self, rows_to_run: int) -> None:
        self.rows_to_run = rows_to_run
        self.finished_walls: list[float] = []
        self.finished_overheads: list[float] = []
        self._said: set[str] = set()

    def row_finished(self, result: dict[str, Any]) -> None:
        wall = result.get("row_wall_s")
        if not isinstance(wall, (int, float)):
            return
        self.finished_walls.append(float(wall))
        train_s = result.get("total_time_s")
        if isinstance(train_s, (int, float)):
            self.finished_overheads.append(max(0.0, float(wall) - float(train_s)))

    def line(self, name: str, heartbeat: Path, elapsed_s: float) -> Optional[str]:
        """The ETA line for row ``name`` once its heartbeat shows a timed step (once per row)."""
        if name in self._said:
            return None
        try:
            hb = json.loads(heartbeat.read_text())
        except (OSError, ValueError):
            return None
        step_s, done, total = hb.get("step_s"), hb.get("done"), hb.get("total")
        if not isinstance(step_s, (int, float)) or not isinstance(done, int) or not isinstance(total, int):
            return None
        self._said.add(name)
        train_left = max(0, total - done) * float(step_s)
        if self.finished_overheads:
            overhead = sum(self.finished_overheads) / len(self.finished_overheads)
            # Of the overhead, this row has already spent its start-up: what of its elapsed
            # time was not training (training so far ~ steps done x step time).
            row_left = train_left + max(0.0, overhead - elapsed_s + done * float(step_s))
            note = ""
        else:
            row_left = train_left
            note = " + evaluation and max-batch search"
        this_row = elapsed_s + row_left
        per_row = (sum(self.finished_walls) / len(self.finished_walls)) if self.finished_walls else this_row
        rows_after = max(0, self.rows_to_run - len(self.finished_walls) - 1)
        total_left = row_left + rows_after * per_row
        # Until a row finishes, nothing measured how long the rest of a row takes: the whole
        # bench's figure leaves it out as the row's does, and says so (the max-batch search alone can
        # take many times a row's training).
        bench_note = note if not note or not rows_after else " + each row's evaluation and max-batch search"
        return (f"[{name}] eta: {float(step_s):.2f} s/step, row ~{fmt_duration(row_left)} left{note}; "
                f"bench ~{fmt_duration(total_left)} left{bench_note} "
                f"({rows_after} more row{'s' if rows_after != 1 else ''} after this)")
