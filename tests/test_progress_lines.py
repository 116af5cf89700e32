"""A run whose stderr is a log (a pipe, a file, nohup) and not a terminal drew no bar and wrote
nothing for as long as it tokenized and trained (~25 s of silence): plain lines show it is alive,
none in a quick run's first seconds, then at most one every 30 s, and one closing each phase that
wrote any. Checked with a fake clock, not by waiting."""

from __future__ import annotations

import threading
from itertools import count

import memtrain.runtime.notices as notices
from memtrain.cli import main
from memtrain.runtime.notices import ProgressLines
from test_metrics_log import RUN


def _clock(seconds: list[float]):
    return lambda: seconds[0]


def test_lines_wait_five_seconds_then_come_at_most_every_thirty(capsys):
    now = [100.0]
    lines = ProgressLines("train", True, total=200, unit="step", clock=_clock(now))
    for at, step in ((1, 1), (4.9, 2)):
        now[0] = 100 + at
        lines.update(step)
    assert capsys.readouterr().err == ""  # a run (or a refusal) inside its first seconds says nothing
    now[0] = 105
    lines.update(10, "loss 3.210")
    assert capsys.readouterr().err == "train: step 10/200 (5 s, loss 3.210)\n"
    for at, step in ((20, 11), (34.9, 12)):  # less than 30 s after the last line
        now[0] = 100 + at
        lines.update(step)
    assert capsys.readouterr().err == ""
    now[0] = 135
    lines.update(13)
    now[0] = 140
    lines.close()
    assert capsys.readouterr().err == "train: step 13/200 (35 s)\ntrain: done, step 13/200 in 40 s\n"


def test_a_phase_that_wrote_nothing_closes_silently_and_a_disabled_one_never_writes(capsys):
    now = [0.0]
    quiet = ProgressLines("tokenizing", True, unit="documents", clock=_clock(now))
    quiet.update(500)
    quiet.close()
    off = ProgressLines("tokenizing", False, unit="documents", clock=_clock(now))
    now[0] = 1000
    off.update(500)
    off.close()
    assert capsys.readouterr().err == ""


def test_train_writes_plain_lines_to_a_log_and_leaves_stdout_as_it_was(tmp_path, monkeypatch, capfd):
    """With stderr a file (capfd), the train command writes a tokenizing and a train line and their
    closing lines; stdout's last line is result.json's still. --no-progress, and stderr that is no
    file (an in-process capture), write none."""
    ticks = count(0, 7)  # each look at the clock: 7 s later
    monkeypatch.setattr(notices, "_now", lambda: float(next(ticks)))
    # The heartbeat (its own test below) waits until its phase ends: only update()'s lines here.
    monkeypatch.setattr(notices, "_wait_for", lambda stop, seconds: stop.wait())
    # A cache of this test's own: the token cache ($MEMTRAIN_CACHE, over --cache-dir) is shared by a
    # worker's tests, and an entry an earlier test wrote for the same corpus means no tokenizing.
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    run = [a for a in RUN if a != "--no-progress"]
    assert main([*run, "--out", str(tmp_path / "a")]) == 0
    captured = capfd.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith(("tokenizing ", "train:", "validating:"))]
    assert len(err) == 6, err
    assert err[0].startswith("tokenizing --data default: ") and err[0].endswith(" tokens/s)"), err
    assert err[1].startswith("tokenizing --data default: done, ") and err[1].endswith(" s"), err
    assert err[2].startswith("train: step 1/4 (7 s, loss "), err  # the first step, 7 s into the phase
    assert err[3].startswith("train: done, step 4/4 in "), err
    # The final validation, after the train phase's closing line, has lines of its own.
    assert err[4:] == ["validating: 1/1 batches (7 s)", "validating: done, 1/1 batches in 14 s"], err
    assert captured.out.splitlines()[-1] == f"wrote {tmp_path / 'a' / 'result.json'}"
    assert main([*run, "--no-cache", "--no-progress", "--out", str(tmp_path / "b")]) == 0
    assert "tokenizing" not in capfd.readouterr().err


def test_each_tokenizing_line_names_its_source(tmp_path, monkeypatch, capfd):
    """A run with a validation source of its own tokenizes twice: both phases' lines said
    "tokenizing"; each names the source it reads, --data's and --val-data's."""
    ticks = count(0, 7)
    monkeypatch.setattr(notices, "_now", lambda: float(next(ticks)))
    monkeypatch.setattr(notices, "_wait_for", lambda stop, seconds: stop.wait())
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    text = "".join(f'{{"text": "document {i} of the test, with words enough for a block or two."}}\n'
                   for i in range(40))
    (tmp_path / "train.jsonl").write_text(text)
    (tmp_path / "val.jsonl").write_text(text.replace("document", "page"))
    run = [a for a in RUN if a != "--no-progress"]
    assert main([*run, "--data", str(tmp_path / "train.jsonl"), "--val-data", str(tmp_path / "val.jsonl"),
                 "--out", str(tmp_path / "a")]) == 0
    err = [line for line in capfd.readouterr().err.splitlines() if line.startswith("tokenizing")]
    # The validation source is read first (an unreadable one is refused before --data is tokenized).
    assert [line.split(": ")[0] for line in err] == [f"tokenizing --val-data {tmp_path / 'val.jsonl'}"] * 2 + [
        f"tokenizing --data {tmp_path / 'train.jsonl'}"] * 2, err
    assert [": done, " in line for line in err] == [False, True, False, True], err


class _Beats:
    """A heartbeat wait for a fake clock: each wait moves the clock by the time asked, and after
    ``lines`` waits it blocks until the phase ends (``reached`` is set then), so a test needs no
    sleep and no real time passes."""

    def __init__(self, now: list[float], lines: int) -> None:
        self.now, self.lines, self.asked = now, lines, []
        self.reached = threading.Event()

    def __call__(self, stop: threading.Event, seconds: float) -> bool:
        if len(self.asked) == self.lines:
            self.reached.set()
            return stop.wait()
        self.asked.append(seconds)
        self.now[0] += seconds
        return stop.is_set()


def test_work_that_outlasts_the_cadence_still_writes_lines_while_it_runs(capsys):
    """One tokenizing batch or a first step of minutes called no update(): nothing was written
    until it ended, and a log looked hung. The heartbeat writes at the same cadence meanwhile."""
    now = [100.0]
    beats = _Beats(now, lines=3)
    lines = ProgressLines("train", True, total=200, unit="step", clock=_clock(now), wait=beats)
    assert beats.reached.wait(30)  # an event the heartbeat sets, not a sleep
    assert beats.asked == [5.0, 30.0, 30.0]  # the first line after 5 s, then one every 30 s
    assert capsys.readouterr().err.splitlines() == [
        "train: still running at step 0/200 (5 s)", "train: still running at step 0/200 (35 s)",
        "train: still running at step 0/200 (65 s)"]
    lines.update(1, "loss 3.2")  # the step ends 1 s after the heartbeat's line: not due yet
    now[0] += 1
    lines.close()
    assert capsys.readouterr().err == "train: done, step 1/200 in 66 s\n"
    assert lines._heartbeat is None  # stopped and joined by close()


def test_an_update_due_in_time_leaves_the_heartbeat_silent(capsys):
    now = [0.0]
    lines = ProgressLines("tokenizing", True, unit="documents", clock=_clock(now), wait=lambda stop, s: stop.wait())
    now[0] = 6
    lines.update(50)
    lines.beat()  # what the heartbeat does when it wakes: nothing, a line was written just now
    now[0] = 36
    lines.beat()
    lines.close()
    assert capsys.readouterr().err.splitlines() == [
        "tokenizing: 50 documents (6 s)", "tokenizing: still running at 50 documents (36 s)",
        "tokenizing: done, 50 documents in 36 s"]


def test_a_run_that_moves_writes_its_own_lines_not_the_heartbeats(capsys):
    """Steps every 2 s: the heartbeat, waking when a line is due, wrote "still running" in place of
    every step line (their loss and tokens/s lost). It writes only after `every` s without an update."""
    now = [0.0]
    lines = ProgressLines("train", True, total=100, unit="step", clock=_clock(now), wait=lambda stop, s: stop.wait())
    for step in range(1, 41):
        now[0] = 2.0 * step
        lines.beat()  # the heartbeat, waking as each line falls due
        lines.update(step, "loss 3.2")
        lines.beat()
    assert lines._seconds_to_next() == 30.0  # it sleeps until 30 s after the last update, not at once again
    now[0] = 80 + 29.9  # a step stalls: nothing yet
    lines.beat()
    now[0] = 80 + 30
    lines.beat()
    lines.stop()
    assert capsys.readouterr().err.splitlines() == [
        "train: step 3/100 (6 s, loss 3.2)", "train: step 18/100 (36 s, loss 3.2)",
        "train: step 33/100 (66 s, loss 3.2)", "train: still running at step 40/100 (110 s)"]


def test_a_stopped_phase_writes_nothing_more(capsys):
    """A failed or interrupted phase (stop(), or leaving its with block) writes no closing line,
    and its heartbeat none after the run's error line."""
    now = [0.0]
    with ProgressLines("tokenizing", True, unit="documents", clock=_clock(now),
                       wait=lambda stop, s: stop.wait()) as lines:
        now[0] = 6
        lines.update(50)
    heard = capsys.readouterr().err
    now[0] = 600
    lines.beat()
    lines.update(60)
    lines.close()
    assert heard == "tokenizing: 50 documents (6 s)\n" and capsys.readouterr().err == ""


def test_a_disabled_phase_starts_no_heartbeat():
    before = threading.active_count()
    lines = ProgressLines("train", False, total=3, unit="step")
    assert lines._heartbeat is None and threading.active_count() == before
    lines.close()


def test_the_tokenizing_bar_names_the_source_it_reads(tmp_path, monkeypatch):
    """On a terminal the tqdm bar said only "tokenizing", for --data and for --val-data alike; it
    names its source as the plain lines do. The bars' descriptions are read at tqdm's seam."""
    from memtrain.config.run import DataConfig
    from memtrain.data import cache, prepare_splits

    descriptions: list[str] = []
    real_tqdm = cache.tqdm

    def recording_tqdm(*args, **kwargs):
        descriptions.append(kwargs["desc"])
        return real_tqdm(*args, **{**kwargs, "disable": True})  # drawn as on a terminal, shown nowhere

    monkeypatch.setattr(cache, "tqdm", recording_tqdm)
    for name in ("train", "val"):
        (tmp_path / f"{name}.txt").write_text(f"Some {name} text to tokenize, a sentence or two.\n")
    data = DataConfig(data=str(tmp_path / "train.txt"), val_data=str(tmp_path / "val.txt"),
                      cache_dir=str(tmp_path / "cache"))
    prepare_splits(data, progress=True)
    assert descriptions == [f"tokenizing --val-data {tmp_path / 'val.txt'}", f"tokenizing --data {tmp_path / 'train.txt'}"]
