"""A resumed run opens its checkpoint for the small entries (config, step, data fingerprint) once,
and once more for the tensors: the command line's saved settings, the longer-run check,
check_resume, the --save and --out checks and the data-fingerprint notice all take what that
one read found. They read it once each (seven reads of the file before its weights)."""

from __future__ import annotations

import pytest

import memtrain.checkpoints.exact as exact
from memtrain.cli import main
from memtrain.config.run import build_config
from memtrain.training.resume_check import SMALL_ENTRIES, saved_state
from memtrain.training.train import train
from test_metrics_log import RUN


def _count_loads(monkeypatch) -> list[str]:
    """Every load_plain call from now on, as "small" (memory-mapped: the small entries are read)
    or "full" (load_checkpoint's read of the tensors)."""
    loads: list[str] = []
    real = exact.load_plain

    def counting(f, **kwargs):
        loads.append("small" if kwargs.get("mmap") else "full")
        return real(f, **kwargs)
    monkeypatch.setattr(exact, "load_plain", counting)
    return loads


@pytest.mark.parametrize("longer", [False, True])
def test_a_resumed_train_command_reads_the_checkpoints_small_entries_once(tmp_path, monkeypatch, capsys, longer):
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    # Stopped at step 2 of 4 (its checkpoint there), or finished at 4 and trained longer to 6:
    # --save is the resumed checkpoint and --out holds the run's files, so every check runs.
    stop = [] if longer else ["--stop-after", "2"]
    assert main([*RUN, "--out", str(out), "--save", str(ckpt), *stop]) == 0
    loads = _count_loads(monkeypatch)
    more = ["--steps", "6"] if longer else []
    assert main(["train", "--resume", str(ckpt), *more, "--no-progress"]) == 0, capsys.readouterr().err
    assert loads == ["small", "full"]


def test_a_library_resume_reads_the_small_entries_once(tiny_run, tmp_path, monkeypatch):
    run = {**tiny_run, "steps": 4, "out": str(tmp_path / "a"), "save": str(tmp_path / "a.pt")}
    train(build_config({**run, "stop_after": 2}))
    loads = _count_loads(monkeypatch)
    train(build_config({**run, "resume": str(tmp_path / "a.pt")}))
    assert loads == ["small", "full"]


def test_the_small_entries_hold_no_tensors(tmp_path):
    """What a run keeps of the checkpoint from its checks to its end: no memory-mapped weights."""
    assert main([*RUN, "--out", str(tmp_path / "r"), "--save", str(tmp_path / "c.pt")]) == 0
    state = saved_state(tmp_path / "c.pt")
    assert set(state) <= set(SMALL_ENTRIES) and {"config", "step"} <= set(state)
