"""`memtrain bench` (and train) under signals and concurrency: SIGTERM acts like Ctrl-C, a row process
never outlives its bench, scratch folders are cleaned, a second bench on one --out is refused.

A row is held running by MEMTRAIN_TEST_ROW_SLEEP (tests/row_hold/sitecustomize.py: the row process
sleeps before it starts), so the signal always arrives mid-row; every process started here is
killed in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import TINY_MODEL, cli_flags
from memtrain.bench.process import ROW_PREFIX, clean_stale_row_dirs
from memtrain.cli import main
from memtrain.files.results import read_jsonl


def _flags(small_corpus: Path) -> list[str]:
    settings = {**TINY_MODEL, "data": str(small_corpus), "steps": 2, "warmup_steps": 1, "batch_size": 2,
                "seq_len": 32, "val_blocks": 2}
    out = []
    for k, v in settings.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out + ["--no-maxbatch", "--no-progress"]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent has not reaped it yet).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(cond, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return False


def _row_started(bench: subprocess.Popen) -> tuple[list[int], list[Path]]:
    """(the row's processes, its scratch folders) once the bench has started its row. The scratch
    folder is made just before the row's process, so a child seen beside it is the row: a child
    seen alone may be another, short-lived one (git, which the bench runs to read its commit): under
    load the test saw it and took it for the row."""
    def scratch() -> list[Path]:
        return list(Path(tempfile.gettempdir()).glob(f"{ROW_PREFIX}{bench.pid}-*"))

    assert _wait_for(lambda: bool(scratch()) and bool(_children(bench.pid))), "the bench never started its row"
    return _children(bench.pid), scratch()


ROW_HOLD = Path(__file__).with_name("row_hold")  # its sitecustomize holds a row that many seconds


def _start_bench(small_corpus: Path, out: Path, techniques: str, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "memtrain", "bench", "--techniques", techniques, "--out", str(out),
           *_flags(small_corpus)]
    pythonpath = os.pathsep.join(p for p in (str(ROW_HOLD), os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, **env})


def _kill_all(bench: subprocess.Popen, workers: list[int]) -> None:
    """Whatever the test's outcome, leave no bench or row process behind."""
    for pid in [bench.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    bench.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_keeps_finished_rows_and_a_second_bench_is_refused(small_corpus, tmp_path, capsys):
    out = tmp_path / "b"
    # One finished row first (a real one), then a bench whose next row hangs.
    assert main(["bench", "--techniques", "baseline", "--out", str(out), *_flags(small_corpus)]) == 0
    capsys.readouterr()
    bench = _start_bench(small_corpus, out, "baseline,precision=bf16", {"MEMTRAIN_TEST_ROW_SLEEP": "120"})
    workers: list[int] = []
    try:
        workers, scratch = _row_started(bench)
        assert scratch, "the row's scratch folder is named after its bench"
        # A second bench on the same folder: refused at once, before any row runs.
        assert main(["bench", "--techniques", "baseline", "--out", str(out), *_flags(small_corpus)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --out") and f"pid {bench.pid}" in err[0]

        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
        assert bench.returncode == 130, stderr
        assert stderr.strip().splitlines()[-1].startswith("error: interrupted; partial report of 1 row(s)")
        assert "Traceback" not in stderr
        assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=15), "the row outlived its bench"
        assert not any(p.exists() for p in scratch)
        rows = read_jsonl(out / "results.jsonl")
        assert [r["technique"] for r in rows.rows] == ["baseline"] and rows.skipped == 0
        assert "Baseline" in (out / "report.md").read_text() and "**Partial**" in (out / "report.md").read_text()
    finally:
        _kill_all(bench, workers)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_sigterm_during_the_cleanup_lets_it_finish(small_corpus, tmp_path):
    """SIGTERM, then a second one while the bench waits for its row to stop (a row slow to stop
    ignores SIGTERM until its grace period ends in SIGKILL): the second raised KeyboardInterrupt
    mid-cleanup, the bench exited at once and its row ran on. Now the second is said and waited
    out: the row is stopped, the partial report written, and the bench exits 130 after it."""
    out = tmp_path / "b"
    bench = _start_bench(small_corpus, out, "baseline",
                         {"MEMTRAIN_TEST_ROW_SLEEP": "120", "MEMTRAIN_TEST_ROW_IGNORE_TERM": "1"})
    workers: list[int] = []
    try:
        workers, _ = _row_started(bench)
        time.sleep(1.0)  # the row process is past its start-up, ignoring SIGTERM
        bench.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # inside the 10 s grace period the bench gives its row
        assert bench.poll() is None
        bench.send_signal(signal.SIGTERM)
        _, stderr = bench.communicate(timeout=60)
        gone = not any(_alive(w) for w in workers)
        assert bench.returncode == 130, stderr
        assert "interrupted again" in stderr and "Traceback" not in stderr
        assert stderr.strip().splitlines()[-1].startswith("error: interrupted; partial report of 0 row(s)")
        assert gone, "the bench exited before its row was stopped"
        assert (out / "report.md").is_file()
    finally:
        _kill_all(bench, workers)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux")
def test_sigkilled_bench_leaves_no_row_running_and_its_scratch_is_cleaned_next_run(small_corpus, tmp_path):
    bench = _start_bench(small_corpus, tmp_path / "b", "baseline", {"MEMTRAIN_TEST_ROW_SLEEP": "120"})
    workers: list[int] = []
    try:
        workers, scratch = _row_started(bench)
        assert scratch
        bench.kill()  # SIGKILL: no handler, no finally runs in the bench
        bench.wait()
        # The kernel's parent-death signal stops the row.
        assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=15), "orphaned row"
        assert all(p.exists() for p in scratch)
        assert clean_stale_row_dirs() >= 1  # what the next bench does first
        assert not any(p.exists() for p in scratch)
    finally:
        _kill_all(bench, workers)


def test_sigterm_stops_a_training_run_like_ctrl_c(small_corpus, tmp_path):
    cache = tmp_path / "cache"
    cmd = _endless_train(small_corpus, tmp_path / "run")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(cache)})
    try:
        assert _wait_for(lambda: _training_started(cache)), "never trained"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 130, stderr
        assert stderr.strip().splitlines()[-1].startswith("error: interrupted")
        assert "Traceback" not in stderr and not list(cache.glob(".tmp-*"))
    finally:
        proc.kill()
        proc.wait()


def test_each_test_worker_sweeps_only_its_own_temporary_folder():
    """Under pytest-xdist (tests/conftest.py) a worker's bench scratch and stale-folder sweep
    live in its own temporary folder, which the processes it starts inherit."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        pytest.skip("runs in one process (-n 0)")
    assert Path(tempfile.gettempdir()).name.startswith(f"memtrain-tests-{worker}-")
    out = subprocess.run([sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == tempfile.gettempdir()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and waitpid are POSIX")
def test_a_row_is_stopped_even_when_an_interrupt_left_popens_wait_lock_held():
    """A Ctrl-C or SIGTERM raised inside ``proc.wait(timeout=...)`` can land between CPython taking
    Popen's wait lock and the ``try`` that releases it; a later ``proc.wait()`` then blocks for ever,
    and so did the bench that stopped its row that way. stop_row (and reap) poll waitpid instead."""
    import threading

    from memtrain.bench.process import reap, start_row, stop_row

    for stop in (lambda p: stop_row(p, grace_s=0.5), lambda p: (p.kill(), reap(p))):
        proc = start_row([sys.executable, "-c", "import time; time.sleep(60)"])
        assert proc._waitpid_lock.acquire(False)  # as the interrupted wait left it
        try:
            done = threading.Thread(target=stop, args=(proc,), daemon=True)
            done.start()
            done.join(timeout=20)
            assert not done.is_alive(), "stopping the row blocked on Popen's wait lock"
            assert proc.returncode is not None and not _alive(proc.pid)
        finally:
            proc._waitpid_lock.release()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("when", ["reading the config", "exporting"])
def test_sigterm_is_ctrl_c_from_a_commands_first_line(tmp_path, monkeypatch, capsys, when):
    """SIGTERM became KeyboardInterrupt only around training: while train read its config, or
    during an export, it ended the process at once (exit 143, no line, an export's scratch
    folder left beside its destination)."""
    import memtrain.cli as cli
    import memtrain.inference.export as export

    def terminated(*args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this returns

    if when == "reading the config":
        monkeypatch.setattr(cli, "config_from_args", terminated)
        argv = ["train", "--steps", "1", "--out", str(tmp_path / "run")]
    else:
        ckpt = tmp_path / "run" / "ck.pt"
        assert cli.main(["train", *cli_flags({**TINY_MODEL, "steps": 1, "batch_size": 1, "seq_len": 16,
                                              "val_blocks": 1, "warmup_steps": 0}),
                         "--no-progress", "--out", str(tmp_path / "run"), "--save", str(ckpt)]) == 0
        monkeypatch.setattr(export, "save_tokenizer", terminated)
        argv = ["export", str(ckpt), str(tmp_path / "hf")]
    capsys.readouterr()

    def unhandled(signum: int, frame: object) -> None:  # what the test sees if the command sets no handler
        raise RuntimeError("SIGTERM reached the default action")

    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = cli.main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: interrupted")
    assert not any(p.name.startswith(".hf.") for p in tmp_path.iterdir()) and not (tmp_path / "hf").exists()


def _hung_up_terminal() -> tuple[int, int]:
    """A pseudo-terminal (master, slave): once the master is closed, every write to the slave
    answers EIO, as a terminal whose ssh session closed does."""
    return os.openpty()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("on_terminal", ["stdout", "stderr"])
def test_sighup_stops_a_bench_like_sigterm_even_with_its_terminal_gone(small_corpus, tmp_path, on_terminal):
    """SIGHUP (an ssh session closing) ended the bench at once: no partial report, the row's
    scratch left. It stops like SIGTERM now, and the lines it writes to the hung-up terminal
    (EIO) are dropped instead of becoming a traceback that stopped the report being written."""
    out = tmp_path / "b"
    master, slave = _hung_up_terminal()
    cmd = [sys.executable, "-m", "memtrain", "bench", "--techniques", "baseline", "--out", str(out), *_flags(small_corpus)]
    pythonpath = os.pathsep.join(p for p in (str(ROW_HOLD), os.environ.get("PYTHONPATH")) if p)
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, on_terminal: slave}
    bench = subprocess.Popen(cmd, **streams, text=True, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath,
                                  "MEMTRAIN_TEST_ROW_SLEEP": "120"})
    os.close(slave)
    workers: list[int] = []
    try:
        workers, scratch = _row_started(bench)
        os.close(master)  # the terminal hangs up
        master = -1
        bench.send_signal(signal.SIGHUP)
        stdout, stderr = bench.communicate(timeout=60)
        assert bench.returncode == 130, stderr
        assert "Traceback" not in (stdout or "") + (stderr or "")
        if on_terminal == "stdout":
            assert stderr.strip().splitlines()[-1].startswith("error: interrupted; partial report of 0 row(s)")
        assert _wait_for(lambda: not any(_alive(w) for w in workers), timeout=15), "the row outlived its bench"
        assert scratch and not any(p.exists() for p in scratch)
        assert "**Partial**" in (out / "report.md").read_text()
    finally:
        if master >= 0:
            os.close(master)
        _kill_all(bench, workers)


def test_sighup_stops_a_training_run_whose_terminal_hung_up(small_corpus, tmp_path):
    """A train whose terminal hung up and then got SIGHUP: exit 130 like SIGTERM (it died of
    SIGHUP, its token-cache scratch left), the curve so far kept; the error line written to the
    hung-up terminal (EIO) is dropped, not a traceback (which made the exit 1)."""
    cache = tmp_path / "cache"
    cmd = _endless_train(small_corpus, tmp_path / "run")
    master, slave = _hung_up_terminal()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=slave, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(cache)})
    os.close(slave)
    try:
        assert _wait_for(lambda: _training_started(cache)), "never trained"
        time.sleep(1.0)
        os.close(master)
        master = -1
        proc.send_signal(signal.SIGHUP)
        proc.wait(timeout=60)
        assert proc.returncode == 130
        assert not list(cache.glob(".tmp-*"))
        assert (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    finally:
        if master >= 0:
            os.close(master)
        proc.kill()
        proc.wait()


def test_a_sighup_the_command_was_started_ignoring_stays_ignored():
    """`nohup memtrain ...` asks for the run to outlive its terminal: SIGHUP stays ignored."""
    from memtrain.runtime.signals import sigterm_as_interrupt

    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with sigterm_as_interrupt():
            assert callable(signal.getsignal(signal.SIGHUP))
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.parametrize("verb", ["train", "bench"])
def test_stdout_whose_reader_left_loses_nothing(small_corpus, tmp_path, verb):
    """`memtrain train ... | head -1`: once the reader has gone every print raises EPIPE. A train
    lost its whole run to its first note (exit 1, no --out folder), a bench ended with exit 1
    after its report. Output no one reads is dropped; the run and its files are whole, exit 0."""
    out = tmp_path / "run"
    flags = [f for f in _flags(small_corpus) if verb == "bench" or f != "--no-maxbatch"] + ["--out", str(out)]
    cmd = [sys.executable, "-m", "memtrain", verb, *(["--techniques", "baseline"] if verb == "bench" else []), *flags]
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the first line
    try:
        proc = subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert "Broken pipe" not in proc.stderr and "Traceback" not in proc.stderr
    if verb == "train":
        assert json.loads((out / "result.json").read_text())["steps"] == 2
        assert len((out / "metrics.jsonl").read_text().splitlines()) >= 2
    else:
        assert [r["technique"] for r in read_jsonl(out / "results.jsonl").rows] == ["baseline"]
        assert "Partial" not in (out / "report.md").read_text()


def _endless_train(small_corpus: Path, out: Path) -> list[str]:
    """A `memtrain train` command on the tiny model that runs until it is stopped."""
    settings = {**TINY_MODEL, "data": str(small_corpus), "steps": 100000, "warmup_steps": 1, "batch_size": 2,
                "seq_len": 32, "val_blocks": 2, "out": str(out)}
    return [sys.executable, "-m", "memtrain", "train", "--no-progress", *cli_flags(settings)]


def _training_started(cache: Path) -> bool:
    """The run's token-cache entry is published, just before its first step (its signal
    handlers are set earlier)."""
    return any((d / "meta.json").exists() for d in cache.glob("[0-9a-f]*"))


def test_a_train_whose_terminal_closes_without_a_sighup_finishes(small_corpus, tmp_path):
    """A job left running when its terminal closed (`disown`, `setsid`: no SIGHUP comes): its
    final lines met EIO and the run ended exit 1, a finished run reported as failed. What no one
    can read is dropped now; exit 0, the result written."""
    out = tmp_path / "run"
    settings = {**TINY_MODEL, "data": str(small_corpus), "steps": 20, "warmup_steps": 1, "batch_size": 2,
                "seq_len": 32, "val_blocks": 2, "out": str(out)}
    master, slave = _hung_up_terminal()
    proc = subprocess.Popen([sys.executable, "-m", "memtrain", "train", *cli_flags(settings)], stdout=slave,
                            stderr=slave, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    try:
        assert os.read(master, 4096)  # the defaults note, said before the run starts
    finally:
        os.close(master)  # the terminal goes away before the run's last lines
    try:
        assert proc.wait(timeout=300) == 0
        assert json.loads((out / "result.json").read_text())["steps"] == 20
    finally:
        proc.kill()
        proc.wait()


def test_a_time_limit_rearms_the_outer_real_time_timer_it_borrowed():
    """time_limit (a chat template's render) takes the process's one real-time timer: an outer
    timer (pytest-timeout's, an embedding program's) was cancelled for good when the block ended."""
    from memtrain.runtime.signals import TimeLimitExceeded, time_limit

    fired: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with time_limit(5.0):
            pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < left <= 30.0, left  # re-armed with what it had left
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(TimeLimitExceeded):
            with time_limit(0.01):
                while True:
                    pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 0.05
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired  # the outer handler never ran inside the block: the limit's did


def _outer_timer_cleared():
    """Cancel the outer real-time timer (pytest-timeout's) for a test of time_limit without one; re-arm it after."""
    left, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    return lambda: signal.setitimer(signal.ITIMER_REAL, left, interval) if left > 0 else None


def test_a_time_limit_that_ended_leaves_no_alarm_and_the_programs_own_handler():
    """Without an outer timer (a plain `memtrain train` rendering its chat records) a limit that ended
    in time must never go off later (SIGALRM's default action ends the process), and a program's own
    SIGALRM handler is the one its next alarm runs."""
    from memtrain.runtime.signals import time_limit

    fired: list[int] = []
    rearm = _outer_timer_cleared()
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        with time_limit(0.05):
            pass
        time.sleep(0.3)
        assert not fired  # the limit's alarm is gone with its block
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        time.sleep(0.3)
        assert fired == [1]  # the program's alarm, its handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        rearm()


def test_a_time_limit_gives_the_outer_timer_back_less_the_time_it_took_and_with_its_interval():
    """The outer timer is due when it was due: the block's time counts against it, and a periodic one
    keeps its period."""
    from memtrain.runtime.signals import time_limit

    rearm = _outer_timer_cleared()
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0, 7.0)
        with time_limit(5.0):
            time.sleep(1.0)
        left, interval = signal.getitimer(signal.ITIMER_REAL)
        assert left <= 29.0 and interval == pytest.approx(7.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        rearm()


def test_a_time_limit_stops_its_block_at_its_time():
    from memtrain.runtime.signals import TimeLimitExceeded, time_limit

    rearm = _outer_timer_cleared()
    started = time.monotonic()
    try:
        with pytest.raises(TimeLimitExceeded):
            with time_limit(0.2):
                while True:
                    pass
    finally:
        rearm()
    assert 0.2 <= time.monotonic() - started < 1.5
