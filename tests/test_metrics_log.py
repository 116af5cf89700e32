"""metrics.jsonl written as training goes, and the TensorBoard / wandb sinks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY_MODEL
from memtrain.cli import main

FLAGS = [x for k, v in TINY_MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]
RUN = ["train", "--steps", "4", "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1", "--no-progress",
       "--warmup-steps", "1", *FLAGS]


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_metrics_jsonl_has_one_line_per_step_and_matches_result(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out)]) == 0
    lines = _lines(out)
    steps = [ln for ln in lines if "loss" in ln]
    assert [ln["step"] for ln in steps] == [1, 2, 3, 4]
    for ln in steps:
        assert {"lr", "grad_norm", "tokens_per_s", "rss_peak_bytes"} <= ln.keys()
        assert ln["grad_norm"] > 0 and ln["tokens_per_s"] > 0
    result = json.loads((out / "result.json").read_text())
    assert [ln["loss"] for ln in steps] == pytest.approx(result["loss_history"])
    assert lines[-1]["val_loss"] == pytest.approx(result["val_loss"])


def test_a_run_without_clipping_logs_each_step_with_no_gradient_norm(tmp_path, capsys):
    """--grad-clip 0 computes no gradient norm: each line says none, and the run ends as any other."""
    out = tmp_path / "r"
    assert main([*RUN, "--grad-clip", "0", "--out", str(out)]) == 0
    steps = [ln for ln in _lines(out) if "loss" in ln]
    assert [ln["step"] for ln in steps] == [1, 2, 3, 4] and all(ln.get("grad_norm") is None for ln in steps)


def test_a_run_that_dies_keeps_its_curve(tmp_path, monkeypatch, capsys):
    import memtrain.training.train as T

    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(T, "evaluate", boom)  # the run fails after its last step, before result.json
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out)]) == 1
    assert not (out / "result.json").exists()
    assert [ln["step"] for ln in _lines(out)] == [1, 2, 3, 4]


def test_a_failure_after_the_last_step_still_saves_the_trained_steps(tmp_path, monkeypatch, capsys):
    """The final evaluation failed (on a GPU: out of memory) after every step had run: --save was
    never written and the trained weights were lost. They are saved as the run's end, a note says
    where, and the failure's line is still the last one (exit 1)."""
    import torch

    import memtrain.training.train as T

    def boom(*a, **k):
        raise RuntimeError("killed")

    monkeypatch.setattr(T, "evaluate", boom)
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    assert main([*RUN, "--out", str(out), "--save", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error:") and "4 trained steps are saved in" in err[-2]
    assert torch.load(ckpt, weights_only=True)["step"] == 4 and not (out / "result.json").exists()


def test_an_interrupt_while_the_result_is_written_still_writes_the_final_checkpoint(tmp_path, monkeypatch, capsys):
    """A Ctrl-C (or SIGTERM, which memtrain turns into one) while result.json was being written
    skipped the final checkpoint: every step since the last periodic one was lost (all of them
    without --save-every). The checkpoint is written first; the run still ends as interrupted."""
    import torch

    import memtrain.cli as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "write_json_atomic", interrupted)
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    assert main([*RUN, "--out", str(out), "--save", str(ckpt), "--save-every", "2"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: interrupted")
    assert torch.load(ckpt, weights_only=True)["step"] == 4 and not (out / "result.json").exists()


def test_a_run_interrupted_in_its_final_evaluation_resumes_to_its_result(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) in the final evaluation kept the trained steps in --save but wrote no
    result.json, and `train --resume` refused the checkpoint: "is at step 4, this run ends at step
    4". The resume runs the final evaluation only and writes the result the uninterrupted run
    wrote: the same keys, losses and perplexity (step times and memory null: no step ran), and
    appends the evaluation's metrics line. A second resume, the result written, is refused."""
    import memtrain.training.train as T

    full = tmp_path / "full"
    assert main([*RUN, "--out", str(full)]) == 0
    real = T.evaluate

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "evaluate", interrupted)
    out, ckpt = tmp_path / "r", tmp_path / "r" / "c.pt"
    assert main([*RUN, "--out", str(out), "--save", str(ckpt)]) == 130
    assert not (out / "result.json").exists()
    monkeypatch.setattr(T, "evaluate", real)
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 0, capsys.readouterr().err
    assert "no step ran" in capsys.readouterr().out
    want, got = (json.loads((d / "result.json").read_text()) for d in (full, out))
    assert got.keys() == want.keys() and got["memory"].keys() == want["memory"].keys()
    for key in ("val_loss", "val_ppl", "loss_history", "train_loss", "steps", "tokens", "stopped_early"):
        assert got[key] == want[key], key
    assert got["steps_run"] == 0 and got["step_time_s"]["median"] is None and got["memory"]["peak_bytes"] is None
    last = _lines(out)[-1]
    assert last["step"] == 4 and last["val_loss"] == want["val_loss"] and last["resumed_from_step"] == 4
    before = (out / "result.json").read_bytes()
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds its result" in err and "larger --steps" in err and len(err.splitlines()) == 1
    assert (out / "result.json").read_bytes() == before
    # Into a new folder too: the run's own --out holds the result of that step.
    assert main(["train", "--resume", str(ckpt), "--out", str(tmp_path / "again"), "--no-progress"]) == 2
    assert "holds its result" in capsys.readouterr().err and not (tmp_path / "again").exists()


def test_log_every_and_bad_report_to(tmp_path, capsys):
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out), "--log-every", "3"]) == 0
    assert [ln["step"] for ln in _lines(out) if "loss" in ln] == [3, 4]  # every 3rd step and the last
    assert main([*RUN, "--out", str(tmp_path / "bad"), "--report-to", "mlflow"]) == 2
    assert "unknown --report-to 'mlflow'" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_tensorboard_event_file_reads_back(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out), "--report-to", "tensorboard"]) == 0
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([ln["loss"] for ln in _lines(out) if "loss" in ln], rel=1e-6)
    assert "train/lr" in acc.Tags()["scalars"]


def test_wandb_offline(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "r"
    assert main([*RUN, "--out", str(out), "--report-to", "wandb"]) == 0
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
