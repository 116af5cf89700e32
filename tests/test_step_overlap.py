"""The loop's overlap of steps: a single-process GPU run queues step N+1 before it reads step N's
loss (memtrain.training.readings), and times steps with device events instead of synchronizing.

Forced on the CPU here, it must give the same run, read the losses together where a metrics line,
an evaluation, a checkpoint or the end needs them (after the next step is queued, or before it where
the model is needed) and never between, and stop a diverged run before a checkpoint keeps it. The
GPU tests check what only CUDA shows: the read waits for its own step and not for work queued after
it, and event timing covers the device's work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import memtrain.training.train as train_module
from memtrain.checkpoints.exact import load_checkpoint
from memtrain.config.run import build_config
from memtrain.metrics import StepTimer
from memtrain.training.readings import StepReadings
from memtrain.training.step import build_state, queue_run_step
from memtrain.training.train import LossDiverged, overlaps_steps, train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _force_overlap(monkeypatch) -> None:
    monkeypatch.setattr(train_module, "overlaps_steps", lambda state, sync_steps, world_size: True)


class _Position:
    """The loader's state_dict protocol, for reading a checkpoint back without data."""

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _metrics(out: str) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _spy(monkeypatch) -> list[str]:
    """The loop's order of events: ``sync`` (a step run and read at once), ``queue`` (a step
    queued, not read), ``read`` (a queued step's loss read), ``save`` (a checkpoint)."""
    events: list[str] = []
    real_queue, real_run, real_loss, real_save = (train_module.queue_run_step, train_module.run_step,
                                                  StepReadings.losses, train_module.save_checkpoint)

    def queue(*a, **k):
        events.append("queue")
        return real_queue(*a, **k)

    def run(*a, **k):
        events.append("sync")
        return real_run(*a, **k)

    def losses(self):
        if isinstance(self._values, torch.Tensor) and self._read is None:  # queued steps' losses, one read
            events.append("read")
        return real_loss(self)

    def save(path, state):
        events.append(f"save{state.step}")
        return real_save(path, state)

    monkeypatch.setattr(train_module, "queue_run_step", queue)
    monkeypatch.setattr(train_module, "run_step", run)
    monkeypatch.setattr(StepReadings, "losses", losses)
    monkeypatch.setattr(train_module, "save_checkpoint", save)
    return events


@pytest.mark.parametrize("log_every", [1, 4])
def test_an_overlapped_run_is_the_same_run(tiny_run, tmp_path, monkeypatch, log_every):
    base = {**tiny_run, "steps": 7, "eval_every": 3, "dropout": 0.1, "log_every": log_every}
    plain = train(build_config({**base, "out": str(tmp_path / "plain")}), log_metrics=True)
    _force_overlap(monkeypatch)
    lagged = train(build_config({**base, "out": str(tmp_path / "lagged")}), log_metrics=True)
    assert lagged["loss_history"] == plain["loss_history"] and len(plain["loss_history"]) == 7
    assert lagged["train_loss_mean"] == plain["train_loss_mean"] and lagged["train_loss"] == plain["train_loss"]
    assert lagged["val_history"] == plain["val_history"] and lagged["val_loss"] == plain["val_loss"]
    assert lagged["step_time_s"]["median"] > 0 and lagged["data_wait_share"] is not None
    same = ("step", "loss", "lr", "grad_norm", "val_loss")
    assert ([{k: m.get(k) for k in same} for m in _metrics(lagged["config"]["train"]["out"])]
            == [{k: m.get(k) for k in same} for m in _metrics(plain["config"]["train"]["out"])])


def test_losses_are_read_together_where_a_step_is_needed_and_never_between(
        tiny_run, tmp_path, monkeypatch):
    """Metered steps (the first two) run and are read at once; the losses of the steps up to
    one that a checkpoint (every 4) or the end needs are read together, in one read, before
    the next step is queued; no step between is read (no metrics lines in this run)."""
    _force_overlap(monkeypatch)
    events = _spy(monkeypatch)
    train(build_config({**tiny_run, "steps": 9, "save": str(tmp_path / "ck.pt"), "save_every": 4}))
    assert events == ["sync", "sync",
                      "queue", "queue", "read", "save4",
                      "queue", "queue", "queue", "queue", "read", "save8",
                      "queue", "read", "save9"]


def test_a_metrics_line_reads_the_steps_since_the_last_read_after_the_next_step_is_queued(
        tiny_run, monkeypatch):
    _force_overlap(monkeypatch)
    events = _spy(monkeypatch)
    result = train(build_config({**tiny_run, "steps": 9, "log_every": 3}), log_metrics=True)
    # step 3 logs: steps 3 read after 4 is queued; step 6 logs: steps 4-6 read after 7 is queued
    assert events == ["sync", "sync", "queue", "queue", "read", "queue", "queue", "queue", "read",
                      "queue", "queue", "read"]
    assert [m["step"] for m in _metrics(result["config"]["train"]["out"]) if "loss" in m] == [3, 6, 9]


def test_an_overlapped_run_resumes_exactly(tiny_run, tmp_path, monkeypatch):
    """Stopped at a checkpoint and resumed, an overlapped run reading its losses in groups has
    the loss history of one uninterrupted run."""
    _force_overlap(monkeypatch)
    whole = train(build_config({**tiny_run, "steps": 9, "out": str(tmp_path / "whole")}))
    ck = str(tmp_path / "ck.pt")
    train(build_config({**tiny_run, "steps": 9, "stop_after": 5, "save": ck, "out": str(tmp_path / "first")}))
    resumed = train(build_config({**tiny_run, "steps": 9, "resume": ck, "out": str(tmp_path / "second")}))
    assert resumed["loss_history"] == whole["loss_history"] and len(whole["loss_history"]) == 9


@pytest.mark.parametrize("losses", [[torch.tensor(1.1), torch.tensor(2.3)], [1.1, 2.3]])
def test_readings_give_the_steps_losses_and_the_last_ones_gradient_norm_apart(losses):
    """Read as one tensor or one by one, the losses are the steps' only, exactly as float() reads
    each, and the norm comes on its own."""
    want = [float(v) for v in losses]
    readings = StepReadings(losses, torch.tensor(0.7))
    assert readings.losses() == want and readings.grad_norm() == float(torch.tensor(0.7))
    assert StepReadings(losses).losses() == want and StepReadings(losses).grad_norm() is None


def test_without_overlap_every_step_is_read_at_once(tiny_run, monkeypatch):
    events = _spy(monkeypatch)
    train(build_config({**tiny_run, "steps": 5}))
    assert events == ["sync"] * 5


def _overlapped_with_nan_at(step: int, monkeypatch) -> list[int]:
    """Force overlap and make step ``step``'s loss NaN (its update still happens); the list
    gets the number of each step queued."""
    _force_overlap(monkeypatch)
    real_queue = train_module.queue_run_step
    queued: list[int] = []

    def nan_at(state, micro, **k):
        total = real_queue(state, micro, **k)
        queued.append(len(train_module.METERED_STEPS) + len(queued) + 1)  # metered steps run through run_step
        return total * float("nan") if queued[-1] == step else total

    monkeypatch.setattr(train_module, "queue_run_step", nan_at)
    return queued


def test_a_diverged_loss_stops_an_overlapped_run_before_a_checkpoint_keeps_it(tiny_run, tmp_path, monkeypatch):
    """The loss of step 5 becomes NaN. Step 6 is queued before it is read, but the run stops
    there, naming step 5, and the checkpoint on disk is step 3's, with finite weights."""
    queued = _overlapped_with_nan_at(5, monkeypatch)
    ck = tmp_path / "ck.pt"
    cfg = build_config({**tiny_run, "steps": 9, "save": str(ck), "save_every": 3})
    with pytest.raises(LossDiverged, match="became nan at step 5"):
        train(cfg)
    assert queued[-1] == 6  # step 5 is read with step 6, the next one a checkpoint needs
    state = build_state(cfg, torch.device("cpu"), schedule=True)
    state.loader = _Position()
    load_checkpoint(str(ck), state)
    assert state.step == 3 and len(state.losses) == 3
    assert all(torch.isfinite(p).all() for p in state.model.parameters())
    assert not (Path(tiny_run["out"]) / "result.json").exists()


def test_a_diverged_loss_at_a_checkpoint_step_is_never_saved(tiny_run, tmp_path, monkeypatch):
    queued = _overlapped_with_nan_at(3, monkeypatch)
    ck = tmp_path / "ck.pt"
    with pytest.raises(LossDiverged, match="at step 3"):
        train(build_config({**tiny_run, "steps": 9, "save": str(ck), "save_every": 3}))
    assert queued[-1] == 3 and not ck.exists()


def test_overlap_is_chosen_only_for_a_single_process_cuda_run_of_the_plain_step(tiny_run):
    cfg = build_config(tiny_run)
    state = build_state(cfg, torch.device("cpu"))
    assert not overlaps_steps(state, sync_steps=False, world_size=1)  # a CPU has no queue to keep full
    state.device = torch.device("cuda")  # only the policy reads it
    assert overlaps_steps(state, sync_steps=False, world_size=1)
    assert not overlaps_steps(state, sync_steps=True, world_size=1)
    assert not overlaps_steps(state, sync_steps=False, world_size=2)  # the loss mean reads every rank
    state.step_fn = lambda *a, **k: 0.0  # a distributed wrap's own step reads its loss itself
    assert not overlaps_steps(state, sync_steps=False, world_size=1)
    with pytest.raises(ValueError, match="single-process step"):
        queue_run_step(state, [])


def test_the_overlapped_timer_reports_what_the_synchronizing_one_does_on_a_cpu():
    """On a CPU the marks are clock readings: the same step times, and each data wait stays
    with its own step though the times are read later."""
    clocks = [FakeClock(), FakeClock()]
    timers = [StepTimer(device="cpu", warmup=1, clock=clocks[0]), StepTimer(device="cpu", warmup=1, clock=clocks[1],
                                                                            overlap=True)]
    for timer, clock in zip(timers, clocks):
        for i in range(5):
            with timer.data_wait():
                clock.now += 1.0 + i
            with timer.step():
                clock.now += 3.0 + i
    plain, lagged = (t.summary() for t in timers)
    assert plain == lagged and plain.steps == 4 and plain.data_wait_s == 2 + 3 + 4 + 5
    assert timers[1].step_times == [4.0, 5.0, 6.0, 7.0] and timers[1].first_step_s == 3.0
    # Between two steps the host only waited for data: the device idled exactly that long.
    assert plain.device_idle_s == 2 + 3 + 4 + 5
    assert plain.device_idle_share == pytest.approx(14 / (14 + 22))


@pytest.mark.parametrize("overlap", [False, True])
def test_time_between_steps_spent_on_work_is_not_idling(overlap):
    """An evaluation or a checkpoint between two steps (``skip_gap``) is work: no gap counted."""
    clock = FakeClock()
    timer = StepTimer(device="cpu", warmup=0, clock=clock, overlap=overlap)
    for i in range(3):
        with timer.step():
            clock.now += 1.0
        clock.now += 0.5  # the loop's own host work
        if i == 0:
            clock.now += 10.0  # an evaluation
            timer.skip_gap()
    stats = timer.summary()
    assert timer.idle_gaps == [0.0, 0.0, 0.5] and stats.device_idle_s == 0.5


def test_sync_steps_may_change_on_resume(tiny_run, tmp_path):
    """How a run is timed computes the same numbers: a resumed run may choose either."""
    ck = str(tmp_path / "ck.pt")
    train(build_config({**tiny_run, "steps": 6, "stop_after": 3, "save": ck}))
    resumed = train(build_config({**tiny_run, "steps": 6, "resume": ck, "sync_steps": True}))
    assert resumed["steps_run"] == 3


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@needs_cuda
def test_a_reading_waits_for_its_own_step_and_not_for_work_queued_after_it():
    x = torch.randn(256, 256, device="cuda")
    readings = StepReadings([(x @ x).sum()], torch.tensor(2.0, device="cuda"), defer=True)
    expected = float((x @ x).sum())  # a synchronous read of the same value, for comparison
    torch.cuda._sleep(2_000_000_000)  # about a second of device time, queued after the reading
    assert readings.losses() == [expected] and readings.grad_norm() == 2.0
    assert not torch.cuda.current_stream().query()  # the sleep still runs: the read did not wait for it
    torch.cuda.synchronize()


@pytest.mark.gpu
@needs_cuda
def test_event_timing_covers_the_devices_work():
    timer = StepTimer("cuda", warmup=0, overlap=True)
    for _ in range(3):
        with timer.step():
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time, queued in microseconds
    stats = timer.summary()
    assert stats.steps == 3 and stats.min is not None and stats.min > 0.005


@pytest.mark.gpu
@needs_cuda
def test_event_timing_sees_the_device_idle_only_when_the_host_falls_behind():
    import time

    behind = StepTimer("cuda", warmup=0, overlap=True)
    ahead = StepTimer("cuda", warmup=0, overlap=True)
    for _ in range(3):
        with behind.step():
            torch.cuda._sleep(1_000_000)
        torch.cuda.synchronize()
        time.sleep(0.02)  # the device has nothing queued while the host sleeps
    for _ in range(3):
        with ahead.step():
            torch.cuda._sleep(50_000_000)  # the next step is queued long before this one ends
    idle_behind, idle_ahead = behind.summary().device_idle_s, ahead.summary().device_idle_s
    assert idle_behind > 2 * 0.015 and idle_ahead < 0.002


@pytest.mark.gpu
@needs_cuda
def test_an_overlapped_cuda_run_trains_as_a_synchronized_one(tiny_text_run, tmp_path):
    base = {**tiny_text_run, "steps": 8, "device": "cuda", "eval_every": 4}
    lagged = train(build_config({**base, "out": str(tmp_path / "a")}))
    synced = train(build_config({**base, "out": str(tmp_path / "b"), "sync_steps": True}))
    torch.testing.assert_close(lagged["loss_history"], synced["loss_history"], rtol=1e-5, atol=1e-5)
    assert lagged["config"]["train"]["sync_steps"] is False and lagged["step_time_s"]["median"] > 0


def test_the_loop_counts_no_idling_after_an_evaluation_or_a_checkpoint(tiny_run, tmp_path, monkeypatch):
    skipped: list[int] = []
    real = StepTimer.skip_gap

    def spy(self):
        skipped.append(self._seen + len(self._unread))  # steps timed so far
        return real(self)

    monkeypatch.setattr(StepTimer, "skip_gap", spy)
    result = train(build_config({**tiny_run, "steps": 6, "eval_every": 2, "save": str(tmp_path / "ck.pt"),
                                 "save_every": 3}))
    # evaluations after steps 2 and 4, a save after 3 (the last step's evaluation and save are the final ones)
    assert skipped == [2, 3, 4]
    assert result["device_idle_share"] is not None and 0 <= result["device_idle_share"] < 1


def test_the_sync_steps_help_says_when_an_overlapped_run_reads_its_losses():
    """--sync-steps' help said an overlapped run reads step N's loss after queuing step N+1 (every
    step, one late), which the loop stopped doing when it began reading once per metrics line: the
    help names the metrics line and the loop's cap on unread steps."""
    from memtrain.config.run import TrainConfig
    from memtrain.training.train import READ_EVERY_MAX

    text = " ".join(TrainConfig.__dataclass_fields__["sync_steps"].metadata["help"].split())
    assert "reading step N's loss" not in text
    assert "once per metrics line (--log-every)" in text
    assert f"or {READ_EVERY_MAX} steps" in text
