"""An interrupted ``train`` (Ctrl-C, or SIGTERM, which memtrain turns into one) says where its
trained steps are kept and the command that continues them, before its ``error: interrupted``
line; a finished run names the checkpoint it wrote, before its last line, result.json's."""

from __future__ import annotations

import shlex

import pytest
import torch

import memtrain.cli as cli
from memtrain.cli import main
from test_metrics_log import RUN


def _interrupt_after_step(monkeypatch, at: int) -> None:
    """train()'s per-step callback raises KeyboardInterrupt once ``at`` steps have run."""
    def stopping(warning):
        def on_step(done: int, total: int, median_s) -> None:
            if done == at:
                raise KeyboardInterrupt
        return on_step
    monkeypatch.setattr(cli, "_warn_after_first_step", stopping)


def test_an_interrupted_run_names_its_checkpoint_and_the_resume_command(tmp_path, monkeypatch, capsys):
    _interrupt_after_step(monkeypatch, 3)
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    assert main([*RUN, "--out", str(out), "--save", str(ckpt), "--save-every", "2"]) == 130
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: interrupted")
    assert lines[-2].startswith("note: ") and str(ckpt) in lines[-2], lines
    command = lines[-2].split("`")[1]
    assert shlex.split(command) == ["memtrain", "train", "--resume", str(ckpt)]
    assert torch.load(ckpt, weights_only=True)["step"] == 2
    monkeypatch.undo()
    assert main(shlex.split(command)[1:] + ["--no-progress"]) == 0  # the command it names resumes the run
    assert "steps 4 " in capsys.readouterr().out


@pytest.mark.parametrize("save", [False, True])
def test_an_interrupt_before_any_checkpoint_says_none_was_kept(tmp_path, monkeypatch, capsys, save):
    _interrupt_after_step(monkeypatch, 1)
    out = tmp_path / "r"
    extra = ["--save", str(out / "c.pt"), "--save-every", "2"] if save else []
    assert main([*RUN, "--out", str(out), *extra]) == 130
    note = capsys.readouterr().err.strip().splitlines()[-2]
    assert note.startswith("note: ") and "--save-every" in note and "continues" not in note
    assert not (out / "c.pt").exists()


def test_an_interrupt_while_tokenizing_says_the_run_stopped_before_its_first_step(tmp_path, monkeypatch, capsys):
    """Stopped while it tokenized, a run given --save-every 1 was told "--save-every N writes ...
    every N steps", as if the flag were missing: it says it stopped before its first step."""
    import memtrain.training.train as training

    def tokenizing(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the data is read and tokenized

    monkeypatch.setattr(training, "prepare_splits", tokenizing)
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out), "--save", str(out / "c.pt"), "--save-every", "1"]) == 130
    note = capsys.readouterr().err.strip().splitlines()[-2]
    assert note == (f"note: the run stopped before its first step (while it read the data or built the model), "
                    f"so nothing was saved to {out / 'c.pt'} yet"), note
    assert not (out / "c.pt").exists()


def test_an_interrupt_before_the_first_periodic_checkpoint_names_the_flag_given(tmp_path, monkeypatch, capsys):
    """One step into a run that checkpoints every 2, the note says it stopped before that first
    checkpoint, not that --save-every would write one."""
    _interrupt_after_step(monkeypatch, 1)
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out), "--save", str(out / "c.pt"), "--save-every", "2"]) == 130
    note = capsys.readouterr().err.strip().splitlines()[-2]
    assert "stopped after 1 step, before its first --save-every 2 checkpoint" in note, note
    assert "writes" not in note


def test_a_finished_run_names_the_checkpoint_it_wrote(tmp_path, capsys):
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    assert main([*RUN, "--out", str(out), "--save", str(ckpt)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {out / 'result.json'}"  # the last line, as scripts read it
    assert printed[-2].startswith(f"wrote {ckpt} ")
    assert main([*RUN, "--out", str(tmp_path / "n")]) == 0
    assert not any(line.startswith("wrote ") and ".pt" in line for line in capsys.readouterr().out.splitlines())


def test_a_resumed_run_says_at_which_step_it_resumes(tmp_path, monkeypatch, capsys):
    """A resumed run said nothing of where it picked up: its log showed only the final "steps 4"
    summary. It starts with one line naming the saved step, the run's end and the checkpoint; the
    summary and the last line are unchanged."""
    _interrupt_after_step(monkeypatch, 3)
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    assert main([*RUN, "--out", str(out), "--save", str(ckpt), "--save-every", "2"]) == 130
    assert "resuming" not in capsys.readouterr().out  # a fresh run resumes nothing
    monkeypatch.undo()
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    said = [line for line in printed if line.startswith("resuming")]
    assert said == [f"resuming at step 2 of 4 from {str(ckpt)!r}"], printed
    assert printed.index(said[0]) < next(i for i, line in enumerate(printed) if line.startswith("steps 4 "))
    assert printed[-1] == f"wrote {out / 'result.json'}"
