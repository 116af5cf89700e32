"""Where a fine-tuner coming from HF Trainer would be surprised, each difference said or removed:
a run without --save says its weights were not kept, the summary says what its losses average
(result.json adds the Trainer's train_loss), the defaults line names optimizer defaults that
differ from the Trainer's, the Trainer's default linear schedule is taken, and --help says what a
transformers --model defaults to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memtrain.cli import main
from memtrain.config.run import build_config
from memtrain.data.cache import prepare_tokens


def test_a_run_without_save_says_so_and_its_folder_is_named_as_one_that_saved_nothing(tiny_run, tmp_path, capsys):
    """train writes weights only with --save (the Trainer saves by default): the run says so in
    one note, and export or generate of its --out folder says the run saved no checkpoint and
    how to keep one, where it sent the user after "the checkpoint its run saved with --save"."""
    from conftest import cli_flags

    run = Path(tiny_run["out"])
    assert main(["train", *cli_flags(tiny_run)]) == 0
    said = capsys.readouterr()
    assert "note: no --save: the trained weights were not written; give --save FILE" in said.err
    expected = f"{str(run)!r} is the --out folder of a run that saved no checkpoint: train keeps the weights only with --save"
    for argv in (["export", str(run), str(tmp_path / "exported")], ["generate", str(run), "--prompt", "hi"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
        assert "the checkpoint its run saved" not in err
    assert not (tmp_path / "exported").exists()
    # A run that saved elsewhere is named with its --save, and export's line does not send the
    # user to `memtrain export`.
    assert main(["train", *cli_flags({**tiny_run, "out": str(tmp_path / "run2"), "steps": 2}),
                 "--save", str(tmp_path / "keep.pt")]) == 0
    assert "note: no --save" not in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run2"), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint its run saved with --save ({str(tmp_path / 'keep.pt')!r})" in err and "memtrain export" not in err


def test_the_summary_says_what_its_losses_average_and_result_json_has_the_trainers_train_loss(tiny_run, capsys):
    """train_loss is the mean of the last 10 steps and val_loss covers --val-blocks blocks, where
    the Trainer's train_loss is the mean over every step run and its eval covers the whole split:
    the summary line says both spans, and result.json adds the Trainer's figure and the tokens
    val_loss was read on."""
    from conftest import cli_flags

    run = Path(tiny_run["out"])
    assert main(["train", *cli_flags({**tiny_run, "steps": 12})]) == 0
    out = capsys.readouterr().out
    result = json.loads((run / "result.json").read_text())
    history = result["loss_history"]
    assert len(history) == 12 and result["train_loss_steps"] == 10
    assert result["train_loss"] == pytest.approx(sum(history[-10:]) / 10)
    assert result["train_loss_mean"] == pytest.approx(sum(history) / 12)  # the Trainer's train_loss
    data = result["data"]
    assert data["val_tokens_evaluated"] == tiny_run["val_blocks"] * tiny_run["seq_len"] < data["val_tokens"]
    splits = prepare_tokens(build_config({**tiny_run, "steps": 12}).data, progress=False)  # the run's cached entry
    assert (data["train_tokens"], data["val_tokens"]) == (len(splits.train), len(splits.val))
    assert (f"train loss {result['train_loss']:.4f} (mean of the last 10 steps)" in out
            and f"(on {data['val_tokens_evaluated']:,} of {data['val_tokens']:,} held-out tokens; --val-blocks)" in out), out


def test_the_summary_counts_one_step_in_the_singular(tiny_run, capsys):
    """A one-step run (a resume that adds one step, a smoke test) printed "1 steps in"."""
    from conftest import cli_flags

    assert main(["train", *cli_flags({**tiny_run, "steps": 1, "warmup_steps": 1, "warmup_timing_steps": 0})]) == 0
    out = capsys.readouterr().out
    assert "  1 step in " in out and "1 steps" not in out, out


def test_trains_defaults_line_names_the_optimizer_defaults_the_trainer_sets_otherwise(small_corpus, tmp_path, capsys,
                                                                                        one_thread):
    """A fine-tune of a transformers model at memtrain's lr 3e-4, weight decay 0.1 and beta2 0.95
    (the Trainer's: 5e-5, 0, 0.999) said nothing of them: train's defaults line names each one not
    given; estimate's, whose memory they do not shape, does not."""
    argv = ["--model", "tiny-llama", "--seq-len", "16", "--batch-size", "1"]
    assert main(["train", *argv, "--data", str(small_corpus), "--steps", "2", "--val-blocks", "1", "--no-progress",
                 "--learning_rate", "1e-4", "--out", str(tmp_path / "run")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("defaults used: "))
    assert "weight-decay 0.1 (the Trainer's default is 0; --weight-decay)" in line
    assert "beta2 0.95 (the Trainer's default is 0.999; --beta2)" in line
    assert "lr " not in line  # given, by its Trainer name
    assert main(["estimate", *argv]) == 0
    assert "Trainer" not in capsys.readouterr().out


def test_the_trainers_default_linear_schedule_is_taken_and_decays_as_transformers_does(tiny_run):
    """--lr_scheduler_type linear, the Trainer's default, was refused ("memtrain's --schedule is
    cosine or constant"), so a Trainer recipe could not be matched: it is --schedule linear
    --min-lr-ratio 0, each step after warm-up at transformers' get_linear_schedule_with_warmup rate."""
    from conftest import cli_flags

    steps, warmup, lr = 8, 2, 1e-3
    run = Path(tiny_run["out"])
    assert main(["train", *cli_flags({**tiny_run, "steps": steps, "warmup_steps": warmup}), "--lr", str(lr),
                 "--lr_scheduler_type", "linear"]) == 0
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ran = {line["step"]: line["lr"] for line in lines if "lr" in line}
    assert json.loads((run / "result.json").read_text())["config"]["train"]["schedule"] == "linear"
    import torch
    from transformers import get_linear_schedule_with_warmup

    theirs = get_linear_schedule_with_warmup(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr), warmup, steps)
    for step in range(warmup + 1, steps + 1):  # the rate step N ran at: transformers' scheduler at N - 1
        assert ran[step] == pytest.approx(lr * theirs.lr_lambdas[0](step - 1)), step
    assert ran[steps] < ran[warmup + 1] / 2  # it decays: the check has teeth


@pytest.mark.parametrize("command", ["train", "estimate", "maxbatch"])
def test_help_says_a_transformers_model_defaults_to_sdpa(command, capsys):
    """--help said `--attention ... (default: math)` only, while every verb runs a --model with
    sdpa: a newcomer reading it expected eager attention and its memory."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "a transformers --model defaults to sdpa" in text


def test_help_of_save_says_that_without_it_no_weights_are_kept(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "what export, generate and --resume read. None: the trained weights are not kept." in text
