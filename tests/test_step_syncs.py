"""How often ``memtrain train``'s loop makes the host wait for the device, counted per step.

On a GPU a small model's step lasts milliseconds, and each read of a device value by the host
(``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ``torch.cuda.synchronize``)
drains the queue of kernels the host has launched ahead. These tests run ``train`` on the CPU
with the loop's GPU path forced (it queues the next step before reading the last:
``overlaps_steps``) and every such read patched to count, then count the reads between one
step's launch and the next's. The steady path: no read at all between two metrics lines, and
one read (the losses since the last read and the logged step's gradient norm, in one tensor)
at a step that writes one, under every technique that changes the step (LoRA, accumulation,
clipping, the fp16 loss scaler, the chunked loss) and for a transformers model, whose own
causal-mask builder reads the position ids once per forward, as it does under HF Trainer. Under
fp16 with a for-loop or foreach optimizer torch's GradScaler reads its found-inf flag at every
step; that read is counted apart, and memtrain adds none beside it.
"""

from __future__ import annotations

import collections
import sys
import warnings
from typing import Any, Callable

import pytest
import torch

from conftest import TINY_MODEL
from memtrain.config.run import build_config
from memtrain.training import train as train_module

# The methods through which a host read of a tensor's value goes (a CPU tensor's too: what is
# counted is the read the loop asks for, which on a GPU would wait for the device).
READS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")


class _Reads:
    """Counts the patched reads, per interval between two step launches, with their call sites."""

    def __init__(self) -> None:
        self.intervals: list[collections.Counter[str]] = [collections.Counter()]

    def next_step(self) -> None:
        self.intervals.append(collections.Counter())

    def count(self, what: str) -> None:
        frame = sys._getframe(2)
        if "/torch/optim/" in frame.f_code.co_filename:
            # torch's for-loop and foreach optimizers read their step count, a tensor they keep on
            # the host (on CUDA the default AdamW is the fused one, which reads nothing): no wait.
            return
        if frame.f_code.co_filename.endswith("/torch/amp/grad_scaler.py"):
            self.intervals[-1][f"{what} in torch's GradScaler"] += 1  # its own read, not memtrain's
            return
        while frame is not None and "/torch/" in frame.f_code.co_filename:  # the caller outside torch
            frame = frame.f_back  # type: ignore[assignment]
        where = "?" if frame is None else f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_code.co_name}"
        self.intervals[-1][f"{what} in {where}"] += 1


def _patch_reads(monkeypatch, reads: _Reads) -> None:
    for name in READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *a: Any, _real: Callable = real, _name: str = name, **k: Any) -> Any:
            reads.count(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    real_sync = torch.cuda.synchronize

    def sync(*a: Any, **k: Any) -> None:
        reads.count("cuda.synchronize")
        return real_sync(*a, **k) if torch.cuda.is_available() else None

    monkeypatch.setattr(torch.cuda, "synchronize", sync)


def _count(monkeypatch, run: dict, log_metrics: bool = True) -> tuple[list[collections.Counter[str]], dict]:
    """Train ``run`` on the forced GPU path; the reads of each interval that starts with a step's
    launch and ends at the next one's (the last interval: the last step to the end of training)."""
    monkeypatch.setattr(train_module, "overlaps_steps", lambda state, sync_steps, world_size: True)
    reads = _Reads()
    for name in ("queue_run_step", "run_step"):
        real = getattr(train_module, name)

        def launched(*a: Any, _real: Callable = real, **k: Any) -> Any:
            reads.next_step()
            return _real(*a, **k)

        monkeypatch.setattr(train_module, name, launched)
    real_run = train_module._Loop.run

    def loop_only(self, *a: Any, **k: Any) -> Any:
        _patch_reads(monkeypatch, reads)
        try:
            return real_run(self, *a, **k)
        finally:
            monkeypatch.undo()  # the evaluation and the result after the loop are not steps

    monkeypatch.setattr(train_module._Loop, "run", loop_only)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train_module.train(build_config(run), log_metrics=log_metrics)
    return reads.intervals[1:], result


STEPS, EVERY = 12, 4
METERED = len(train_module.METERED_STEPS)


@pytest.mark.parametrize("techniques", [
    {},
    {"lora_rank": 4},
    {"grad_accum": 2},
    {"grad_clip": 0.0},
    # On CUDA --optim adamw is the fused kernel, which takes the scaler's inf flag on the device;
    # GradScaler with a for-loop or foreach optimizer reads the flag at every step (torch's own).
    {"precision": "fp16", "optim": "adamw-fused"},
    {"loss": "chunked", "loss_chunk": 16},
    {"model": "tiny-llama"},
    {"model": "tiny-llama", "lora_rank": 4, "grad_accum": 2},
], ids=lambda t: "+".join(f"{k}={v}" for k, v in t.items()) or "gpt")
def test_the_steady_path_reads_the_device_once_per_metrics_line_and_never_between(tiny_run, monkeypatch,
                                                                               techniques):
    run = {**tiny_run, "steps": STEPS, "log_every": EVERY, **techniques}
    if "model" in techniques:
        run = {k: v for k, v in run.items() if k not in TINY_MODEL}
    intervals, result = _count(monkeypatch, run)
    assert len(intervals) == STEPS and len(result["loss_history"]) == STEPS
    # transformers' causal-mask builder checks the position ids once per forward (masking_utils),
    # a read HF Trainer's step makes as well; every other read is the loop's own.
    ours = [collections.Counter({k: n for k, n in c.items() if "masking_utils" not in k}) for c in intervals]
    theirs = [sum(n for k, n in c.items() if "masking_utils" in k) for c in intervals]
    micro = run.get("grad_accum", 1)
    assert all(n <= micro for n in theirs), theirs
    if "model" not in techniques:
        assert not any(theirs)
    # Steady steps: after the metered ones, before the last (whose interval holds the final read).
    steady = ours[METERED:-1]
    # Step k's interval reads the steps up to the last one that wrote a metrics line before it
    # (read one step late: after the next step is queued), in one read of one tensor.
    read_at = {done + 1 for done in range(METERED + 1, STEPS) if done % EVERY == 0}
    for k, counter in enumerate(steady, start=METERED + 1):
        if k in read_at:
            assert sum(counter.values()) <= 1, (k, counter)
        else:
            assert not counter, (k, counter)
    assert sum(sum(c.values()) for c in steady) <= len(read_at)


def test_without_metrics_lines_no_steady_step_reads_the_device(tiny_run, monkeypatch):
    """A bench row or a library call (no metrics.jsonl): the losses are read at the end (and at
    evaluations and checkpoints), not at every step."""
    intervals, result = _count(monkeypatch, {**tiny_run, "steps": STEPS}, log_metrics=False)
    assert [dict(c) for c in intervals[METERED:-1]] == [{}] * (STEPS - METERED - 1)
    assert sum(intervals[-1].values()) == 1  # the last read: every step's loss since the metered ones
    assert len(result["loss_history"]) == STEPS


def test_a_long_stretch_without_reads_is_read_every_read_every_max_steps(tiny_run, monkeypatch):
    """No metrics line, evaluation or checkpoint: the losses are still read every READ_EVERY_MAX
    steps (a diverged loss stops the run within that many), one step late, in one read."""
    monkeypatch.setattr(train_module, "READ_EVERY_MAX", 4)
    intervals, result = _count(monkeypatch, {**tiny_run, "steps": STEPS}, log_metrics=False)
    # the metered steps 1-2 are read as they end; then steps 3-6 make a group (read once step 7 is
    # queued), 7-10 another (read at 11), 11-12 the last, read at the end
    reads = [k for k, c in enumerate(intervals, start=1) if c]
    assert reads == [1, 2, 7, 11, STEPS] and all(sum(c.values()) == 1 for c in intervals if c), intervals
    assert len(result["loss_history"]) == STEPS


@pytest.mark.parametrize("optim", ["adamw-foreach", "adamw"])  # adamw: the for-loop kernel on a CPU
def test_fp16_with_a_non_fused_optimizer_reads_only_torchs_own_found_inf_flag(tiny_run, monkeypatch, optim):
    """torch's GradScaler.step reads its found-inf flag on the host (``.item()``) before a for-loop
    or foreach optimizer's step, at every step (HF Trainer's step runs the same GradScaler.step);
    memtrain adds no read of its own: every steady step reads that flag once, and otherwise only
    at metrics lines, as under the fused AdamW."""
    run = {**tiny_run, "steps": STEPS, "log_every": EVERY, "precision": "fp16", "optim": optim}
    intervals, result = _count(monkeypatch, run)
    assert len(result["loss_history"]) == STEPS and result["optimizer_kernel"] != "fused"
    scaler = "item in torch's GradScaler"
    assert [c[scaler] for c in intervals] == [1] * STEPS, intervals
    ours = [collections.Counter({k: n for k, n in c.items() if k != scaler}) for c in intervals]
    read_at = {done + 1 for done in range(METERED + 1, STEPS) if done % EVERY == 0}
    for k, counter in enumerate(ours[METERED:-1], start=METERED + 1):
        assert sum(counter.values()) == (k in read_at), (k, counter)
