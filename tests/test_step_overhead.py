"""What ``memtrain train``'s loop does per step beyond a plain PyTorch loop, counted, not timed.

On a GPU a small model's step lasts milliseconds, and the loop's own work between two steps is
time the device may wait (docs/performance.md, "Host work per step"). These tests count that
work on a CPU: the sorting behind the per-step progress median, and the tensor operations a
steady step runs beyond those of a plain loop over the same model (each one a kernel launch on a
GPU), captured with torch's dispatch mode.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from memtrain.config.run import build_config
from memtrain.metrics import timing
from memtrain.training import train as train_module
from memtrain.training.step import build_state, random_micro_batches


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


class _Ops(TorchDispatchMode):
    """Counts the ATen operators run (views and aliases, which launch nothing, left out), per
    interval between two step launches; paused while the loader fetches (host-side slicing)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self.intervals: list[collections.Counter[str]] = [collections.Counter()]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.on and not func.is_view:
            self.intervals[-1][str(func)] += 1
        return func(*args, **(kwargs or {}))


STEPS = 8


def _memtrain_ops(monkeypatch, run: dict, log_metrics: bool) -> list[collections.Counter[str]]:
    """The operators of each step of ``train``'s loop on the GPU path (forced on the CPU): the
    interval from one step's launch to the next's, its reads of earlier steps included."""
    ops = _Ops()
    monkeypatch.setattr(train_module, "overlaps_steps", lambda state, sync_steps, world_size: True)
    for name in ("queue_run_step", "run_step"):
        real = getattr(train_module, name)

        def launched(*a: Any, _real: Callable = real, **k: Any) -> Any:
            ops.intervals.append(collections.Counter())
            return _real(*a, **k)

        monkeypatch.setattr(train_module, name, launched)
    real_run = train_module._Loop.run

    def run_loop(self: Any, *a: Any, **k: Any) -> Any:
        real_next = self.state.loader.next_group

        def next_group(*a: Any, **k: Any) -> Any:
            ops.on = False
            try:
                return real_next(*a, **k)
            finally:
                ops.on = True

        monkeypatch.setattr(self.state.loader, "next_group", next_group)
        with ops:
            return real_run(self, *a, **k)

    monkeypatch.setattr(train_module._Loop, "run", run_loop)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_module.train(build_config(run), track_memory=False, log_metrics=log_metrics)
    return ops.intervals[1:]


def _plain_step_ops(run: dict) -> collections.Counter[str]:
    """The operators of one steady step (the fifth) of the loop a PyTorch tutorial writes, over
    the same model, optimizer, schedule, precision and clipping: forward, loss / N under
    accumulation, (scaled) backward, (unscale,) clip, step, (update,) schedule, zero_grad; the loss
    kept on the device."""
    cfg = build_config(run)
    torch.manual_seed(0)
    state = build_state(cfg, torch.device("cpu"), schedule=True)
    model, opt, sched, precision = state.model, state.optimizer, state.scheduler, state.precision
    scaler = precision.scaler
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    ops, losses = _Ops(), []
    for i in range(6):
        micro = random_micro_batches(cfg, cfg.train.batch_size, torch.device("cpu"), g)
        with ops if i == 4 else contextlib.nullcontext():
            for x, y in micro:
                with precision.autocast():
                    loss = model(x, y) / len(micro) if len(micro) > 1 else model(x, y)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(opt)
            if cfg.train.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    return ops.intervals[0]


# What a steady step of memtrain's loop runs beyond the plain loop, and why. Each is a kernel
# launch on a GPU. Gone from it: a zero-filled loss total and its add (2 a step; 1 under
# accumulation), a single micro-batch's loss / 1 and its backward (2) and, under fp16, the
# skipped-step count's copy of the scale, comparison, cast and add (4; now 1).
ADDED = {
    # the step's mean loss over its micro-batches, summed on the device (the plain loop keeps
    # only the last micro-batch's): the first one's copied into a total, the second added
    "grad_accum": {"aten._to_copy.default": 1, "aten.add_.Tensor": 1},
    # result.json's skipped_steps: GradScaler's found-inf flag added to a device count, unread
    "fp16": {"aten.add_.Tensor": 1},
}
# On a step that reads (a metrics line): the losses since the last read and the logged step's
# gradient norm stacked into one tensor, for one read (the plain loop would read each).
READ = {"aten.stack.default": 1}


@pytest.mark.parametrize("techniques, added", [
    ({}, {}),
    ({"grad_clip": 0.0}, {}),
    ({"grad_accum": 2}, ADDED["grad_accum"]),
    ({"precision": "fp16"}, ADDED["fp16"]),  # a for-loop AdamW on a CPU
    ({"precision": "fp16", "optim": "adamw-fused"}, ADDED["fp16"]),  # CUDA's default AdamW
], ids=["default", "no-clip", "grad-accum-2", "fp16-for-loop-adamw", "fp16-fused-adamw"])
def test_a_steady_step_runs_the_plain_loops_operators_and_only_these_more(tiny_run, monkeypatch, techniques, added):
    """Captured with torch's dispatch mode: a steady step of ``train``'s loop against one of the
    plain loop, operator by operator; what memtrain adds is exactly ``ADDED``'s, each for a reason."""
    run = {**tiny_run, "steps": STEPS, **techniques}
    plain = _plain_step_ops(run)
    ours = _memtrain_ops(monkeypatch, run, log_metrics=False)
    assert len(ours) == STEPS
    for k, step in enumerate(ours[2:-1], start=3):  # steady: after the first two, before the last
        assert dict(step - plain) == added, (k, dict(step - plain))
        assert not plain - step, (k, dict(plain - step))  # every one of the plain loop's runs


def test_a_step_that_writes_a_metrics_line_adds_one_stack_for_its_one_read(tiny_run, monkeypatch):
    run = {**tiny_run, "steps": STEPS, "log_every": 2}
    plain = _plain_step_ops(run)
    steady = _memtrain_ops(monkeypatch, run, log_metrics=True)[2:-1]
    extras = [dict(step - plain) for step in steady]
    assert all(e in ({}, READ) for e in extras), extras
    # stacked as a logging step is queued (read after the next): steps 4 and 6 of the steady 3-7
    assert extras.count(READ) == 2, extras
    assert all(not plain - step for step in steady)
