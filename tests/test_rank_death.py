"""Ranks never outlive their launcher, and the --out lock lasts as long as anything writes there
(docs/reliability.md, "Signals, processes and locks").

``memtrain train --nproc-per-node N`` runs torch's launcher in-process; torch starts each rank
in a session of its own, so a launcher killed with SIGKILL (which it cannot intercept) used to
leave its ranks training on as orphans, while the kernel freed the launcher's folder lock: a
second run was accepted on the same folder and the two wrote into one metrics.jsonl (NUL
bytes where the second run's truncation met the first one's file offset). Every process
started here is killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main
from memtrain.config.run import ConfigError
from memtrain.files.lock import FolderLock, process_start, register_writer
from memtrain.files.results import LOCK_NAME

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")


def _children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc, no psutil)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rfind(")") + 2:].split()[1]) == pid:
            kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    """Running (a zombie or a vanished pid is not)."""
    return process_start(pid) is not None


def _wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_sigkilled_launcher_takes_its_ranks_and_the_folder_is_free_only_after_them(small_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    run = {**TINY_MODEL, "data": str(small_corpus), "seq_len": 32, "batch_size": 2, "steps": 100_000,
           "warmup_steps": 1, "val_blocks": 1, "warmup_timing_steps": 1, "progress": False,
           "distributed": "ddp", "out": str(out)}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_DIST_TIMEOUT": "60"}
    launcher = subprocess.Popen([sys.executable, "-m", "memtrain", "train", *cli_flags(run), "--nproc-per-node", "2"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    ranks: list[int] = []
    try:
        metrics = out / "metrics.jsonl"
        # Training has begun once rank 0 has logged steps.
        started = _wait_for(lambda: launcher.poll() is None and metrics.is_file() and metrics.stat().st_size > 200, 300)
        assert started, launcher.stderr.read().decode()[-3000:] if launcher.poll() is not None else "no steps in 300 s"
        ranks = [p for p in _children(launcher.pid) if "memtrain" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert len(ranks) == 2, ranks
        # Every rank has signed the lock file as a writer of the folder.
        lock_text = (out / LOCK_NAME).read_text()
        assert all(f"(pid {p}, started" in lock_text for p in ranks), lock_text

        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        accepted_early = []
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            try:  # the folder must stay refused while any rank can still write into it
                with FolderLock(out, "memtrain bench"):
                    if any(_alive(p) for p in ranks):
                        accepted_early.append([p for p in ranks if _alive(p)])
            except ConfigError as exc:
                assert "in use by memtrain train rank" in str(exc)
            time.sleep(0.02)
        survivors = [p for p in ranks if _alive(p)]
        assert not survivors, f"ranks {survivors} outlived their SIGKILLed launcher by 30 s"
        assert not accepted_early, f"the folder was accepted while ranks {accepted_early[0]} still ran"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for p in ranks:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # Once every writer is gone the folder is free: a second run is refused only for the killed
    # run's curve it would overwrite (never for the lock), and nothing writes into that curve.
    killed = metrics.read_bytes()
    time.sleep(1.0)
    assert metrics.read_bytes() == killed and b"\0" not in killed
    second = {**run, "steps": 3, "distributed": "none"}
    capsys.readouterr()
    assert main(["train", *cli_flags(second)]) == 2
    err = capsys.readouterr().err
    assert "already holds metrics.jsonl" in err and "in use" not in err, err
    # With the killed run's curve moved aside, the second run is accepted and writes alone.
    metrics.rename(metrics.with_name("metrics.killed.jsonl"))
    assert main(["train", *cli_flags(second)]) == 0, capsys.readouterr().err
    before = metrics.read_bytes()
    time.sleep(1.0)
    after = metrics.read_bytes()
    assert after == before and b"\0" not in after
    rows = [json.loads(line) for line in after.splitlines()]  # every line whole
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]  # the second run's steps, only


def _writer(folder: Path, what: str) -> subprocess.Popen:
    """A process that registers as a writer of ``folder`` and then waits."""
    code = ("import sys, time; from memtrain.files.lock import register_writer\n"
            "register_writer(sys.argv[1], sys.argv[2]); print('registered', flush=True); time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder), what], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "registered"
    return proc


def test_the_lock_is_refused_while_a_registered_writer_lives(tmp_path):
    with FolderLock(tmp_path, "memtrain train"):
        writer = _writer(tmp_path, "memtrain train rank 1")
    try:  # the holder is gone, its writer is not
        with pytest.raises(ConfigError, match=rf"in use by memtrain train rank 1 \(pid {writer.pid}\)"):
            with FolderLock(tmp_path, "memtrain bench"):
                pass
    finally:
        writer.kill()
        writer.wait()
    with FolderLock(tmp_path, "memtrain bench"):  # the last writer is gone: free again
        pass
    # The new holder starts a fresh list: the dead writer's line is gone.
    assert "rank 1" not in (tmp_path / LOCK_NAME).read_text()


def test_a_writer_line_whose_pid_was_reused_or_gone_is_stale(tmp_path):
    """A pid names one process only while it runs: a line whose start time differs from the
    live process with that pid (a later process got the number), or whose process is gone,
    does not hold the folder."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    parent, parent_start = os.getppid(), process_start(os.getppid())
    (tmp_path / LOCK_NAME).write_text(f"memtrain train (pid 1)\n"
                                      f"writer: memtrain train rank 0 (pid {int(gone.stdout)}, started 1)\n"
                                      f"writer: memtrain train rank 1 (pid {parent}, started {int(parent_start) + 1})\n")
    with FolderLock(tmp_path, "memtrain bench"):
        pass
    (tmp_path / LOCK_NAME).write_text(f"writer: memtrain train rank 1 (pid {parent}, started {parent_start})\n")
    with pytest.raises(ConfigError, match=rf"rank 1 \(pid {parent}\)"):
        with FolderLock(tmp_path, "memtrain bench"):
            pass


def test_register_writer_appends_one_line_per_rank(tmp_path):
    with FolderLock(tmp_path, "memtrain train"):
        register_writer(tmp_path, "memtrain train rank 0")
        register_writer(tmp_path, "memtrain train rank 1")
        lines = (tmp_path / LOCK_NAME).read_text().splitlines()
    assert lines[0] == f"memtrain train (pid {os.getpid()})"
    assert [line.split(" (pid")[0] for line in lines[1:]] == ["writer: memtrain train rank 0", "writer: memtrain train rank 1"]


_GRANDCHILD = """
import os, sys, time
from memtrain.runtime.signals import die_with_parent
die_with_parent(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(os.getpid(), flush=True)
time.sleep(120)
"""


def test_a_process_bound_to_its_parent_dies_with_it():
    """The child starts a grandchild bound to it, then the child is SIGKILLed: the grandchild
    must go too (it would otherwise be reparented and sleep on)."""
    child_code = ("import subprocess, sys, time\n"
                  "g = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=subprocess.PIPE, text=True,"
                  " start_new_session=True)\n"
                  "print(g.stdout.readline().strip(), flush=True); time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", child_code, _GRANDCHILD], stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        assert _alive(grandchild)
        child.kill()
        child.wait()
        assert _wait_for(lambda: not _alive(grandchild), 30), "the grandchild outlived its parent"
    finally:
        try:
            os.kill(grandchild, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_parent_that_died_before_the_binding_is_noticed():
    """The parent may die between the process start and the prctl call; the signal would then
    never come. Given the parent's pid, a changed parent ends the process at once."""
    proc = subprocess.run([sys.executable, "-c", _GRANDCHILD, str(os.getpid() + 10**6)], capture_output=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL and proc.stdout == b""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux")
def test_memtrains_launch_variables_set_by_mistake_are_one_line_not_a_silent_kill(tmp_path):
    """MEMTRAIN_LAUNCHED=1 and a MEMTRAIN_LAUNCHER_PID exported from a shell that once ran a
    launcher, then plain torchrun: every rank compared its parent with that pid and SIGKILLed
    itself (exit 137, no word). A pid that is not the parent (alive, or dead with no launcher's
    error folder left) is one error: line, exit 2; the parent's own pid, and a launcher that died
    and left its error folder, keep the binding."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    base = {**os.environ, "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
            "MEMTRAIN_LAUNCHED": "1", "MEMTRAIN_ERROR_DIR": str(tmp_path / "removed")}

    def version(launcher: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "memtrain", "--version"], capture_output=True, text=True,
                              timeout=120, env={**base, "MEMTRAIN_LAUNCHER_PID": launcher, **env})

    for wrong in (str(os.getppid()), str(gone.pid), "12ab"):  # alive but not the parent, dead, not a pid
        proc = version(wrong)
        assert proc.returncode == 2, (wrong, proc.returncode, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: MEMTRAIN_LAUNCHED=1 and MEMTRAIN_LAUNCHER_PID=")
        assert "unset MEMTRAIN_LAUNCHED, MEMTRAIN_LAUNCHER_PID" in lines[0] and proc.stdout == ""
    assert version(str(os.getpid())).returncode == 0  # this test is the parent: the launcher
    (tmp_path / "left").mkdir()  # what a SIGKILLed launcher leaves behind
    died = version(str(gone.pid), MEMTRAIN_ERROR_DIR=str(tmp_path / "left"))
    assert died.returncode == -signal.SIGKILL and died.stdout == ""


def test_a_folder_holding_only_a_killed_launchers_lock_is_taken_without_a_word(small_corpus, tmp_path, capsys):
    """A launcher SIGKILLed before its ranks wrote anything leaves `--out` holding only
    `.memtrain.lock`: its holder line and one writer line per rank, every process gone. The next
    train takes the folder as a new one: it trains, writes its result, says nothing about the lock
    (no warning, no note), and the lock file then names only itself."""
    gone = [int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                               text=True).stdout) for _ in range(3)]
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text(f"memtrain train --nproc-per-node 2 (pid {gone[0]})\n"
                                 f"writer: memtrain train rank 0 (pid {gone[1]}, started 1)\n"
                                 f"writer: memtrain train rank 1 (pid {gone[2]}, started 1)\n")
    flags = cli_flags({**TINY_MODEL, "data": str(small_corpus), "seq_len": 16, "batch_size": 1, "steps": 1,
                       "warmup_steps": 0, "val_blocks": 1, "progress": False, "cache_dir": str(tmp_path / "cache")})
    assert main(["train", *flags, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "lock" not in err and "warning" not in err and "error" not in err, err
    assert json.loads((out / "result.json").read_text())["steps"] == 1
    assert sorted(p.name for p in out.iterdir()) == sorted([LOCK_NAME, "metrics.jsonl", "result.json"])
    assert (out / LOCK_NAME).read_text() == f"memtrain train (pid {os.getpid()})\n"  # the dead writers gone with it
