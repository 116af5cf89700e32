"""The training loop: learning happens, results follow the contract, resume is exact."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from memtrain.config.run import ConfigError, TrainConfig, build_config
from memtrain.training.step import lr_lambda
from memtrain.training.train import train

CONTRACT_KEYS = {"config", "train_loss", "val_loss", "val_ppl", "steps", "tokens", "step_time_s",
                 "total_time_s", "tokens_per_s", "mfu", "memory", "env"}


def test_result_follows_contract_and_loss_falls(tiny_run):
    cfg = build_config({**tiny_run, "steps": 30, "lr": 3e-3, "warmup_steps": 3})
    r = train(cfg)
    assert CONTRACT_KEYS <= r.keys()
    assert set(r["step_time_s"]) >= {"median", "p10", "p90"}
    assert set(r["memory"]["by_category"]) == {"parameters", "gradients", "optimizer", "activations", "temporaries"}
    assert r["memory"]["peak_bytes"] == sum(r["memory"]["by_category"].values())
    assert r["memory"]["max_allocated_bytes"] is None  # CPU
    assert r["tokens"] == 30 * 4 * 32
    assert r["env"]["device_type"] == "cpu" and r["env"]["torch"] == torch.__version__
    # Untrained loss is ~ln(50257) = 10.8; a few dozen steps on a repetitive corpus go far below.
    assert r["loss_history"][0] > 10.0
    assert r["val_loss"] < 8.5
    assert math.isclose(r["val_ppl"], math.exp(r["val_loss"]))


def test_result_records_the_cache_folder_the_run_used(tiny_run, tmp_path, monkeypatch):
    """MEMTRAIN_CACHE overrides --cache-dir: result.json names the folder whose tokens were read,
    not the setting the variable overrode; without the variable it names --cache-dir."""
    env_cache, flag_cache = tmp_path / "env-cache", tmp_path / "flag-cache"
    monkeypatch.setenv("MEMTRAIN_CACHE", str(env_cache))
    cfg = build_config({**tiny_run, "steps": 3, "warmup_steps": 1, "cache_dir": str(flag_cache)})
    r = train(cfg)
    assert r["config"]["data"]["cache_dir"] == str(env_cache)
    assert any(env_cache.iterdir()) and not flag_cache.exists()  # the tokens were cached there
    monkeypatch.delenv("MEMTRAIN_CACHE")
    assert cfg.recorded()["data"]["cache_dir"] == str(flag_cache)
    assert cfg.recorded()["train"] == cfg.to_dict()["train"]  # nothing else is rewritten


def test_train_prints_the_time_of_its_steps_by_their_count(tiny_run, capsys):
    """`total_time_s` is the wall time of the steps run (no evaluation): the summary line says
    so by their count, as the bench report's "Time, N steps (s)" column does."""
    from conftest import cli_flags
    from memtrain.cli import main

    assert main(["train", *cli_flags({**tiny_run, "steps": 3, "warmup_steps": 1})]) == 0
    out = capsys.readouterr().out
    assert " 3 steps in " in out and " total " not in out, out


def test_schedule_warmup_then_cosine():
    cfg = build_config({"steps": 100, "warmup_steps": 10, "min_lr_ratio": 0.1})
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert 0.1 < f(55) < 1.0
    # Past --steps (the scheduler's last step() reads step == steps; a schedule read further on)
    # the LR stays at its floor instead of climbing back up the cosine.
    assert f(150) == pytest.approx(0.1) and f(190) == pytest.approx(0.1)
    const = lr_lambda(build_config({"steps": 100, "warmup_steps": 10, "schedule": "constant"}))
    assert const(50) == 1.0



def test_the_warmup_help_states_the_ramp_the_schedule_runs():
    """--warmup-steps' help said "from 0 to --lr", while step s runs at (s + 1) / W (the README's
    words, and unlike the Trainer's s / W): the first warm-up step is not at 0."""
    text = next(f.metadata["help"] for f in fields(TrainConfig) if f.name == "warmup_steps")
    assert "from 0 to" not in text and "(s + 1) / W" in text
    f = lr_lambda(build_config({"steps": 100, "warmup_steps": 4}))
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_the_warmup_help_says_the_cap_needs_a_steps():
    """The help said the warm-up is capped at 10% of --steps "when no setting names it", but a run
    that sets neither keeps 200 warm-up steps of its 200: the cap follows a --steps given."""
    text = " ".join(next(f.metadata["help"] for f in fields(TrainConfig) if f.name == "warmup_steps").split())
    assert "When no setting names it" not in text and "When --steps is set" in text
    assert build_config({}).train.warmup_steps == 200 and build_config({"steps": 200}).train.warmup_steps == 20


@pytest.mark.parametrize("lora", [0, 4])
def test_resume_continues_exactly(tiny_run, tmp_path, lora):
    """Stop after 4 of 8 steps, resume, and get the same losses as one uninterrupted run, with
    and without LoRA (tests/test_hf_models.py::test_resume_is_exact: peft's adapters too)."""
    base = {**tiny_run, "steps": 8, "dropout": 0.1, "lora_rank": lora}
    full = train(build_config(base))
    half = train(build_config({**base, "stop_after": 4, "save": str(tmp_path / "half.pt")}))
    assert half["stopped_early"] and half["loss_history"] == full["loss_history"][:4]
    resumed = train(build_config({**base, "resume": str(tmp_path / "half.pt")}))
    assert resumed["steps_run"] == 4
    assert resumed["loss_history"] == full["loss_history"]
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=0)


def test_a_resumed_runs_result_lists_the_evaluations_before_the_interruption(tiny_run, tmp_path, capsys):
    """--eval-every 2 over 6 steps, stopped at 3 and resumed: result.json's val_history held the
    step-4 evaluation only (the checkpoint kept no evaluations), while loss_history covered all
    6 steps. Now it equals the uninterrupted run's; a damaged val_history is refused."""
    from memtrain.cli import main

    base = {**tiny_run, "steps": 6, "eval_every": 2}
    full = train(build_config(base))
    assert [e["step"] for e in full["val_history"]] == [2, 4]
    ckpt = tmp_path / "part.pt"
    train(build_config({**base, "stop_after": 3, "save": str(ckpt)}))
    resumed = train(build_config({**base, "resume": str(ckpt)}))
    assert resumed["val_history"] == full["val_history"]
    state = torch.load(ckpt, weights_only=True)
    state["val_history"] = [{"step": 9, "val_loss": 1.0, "val_ppl": 2.7}]  # a step the run never reached
    torch.save(state, ckpt)
    capsys.readouterr()
    assert main(["train", "--resume", str(ckpt), "--steps", "6", "--out", str(tmp_path / "again")]) == 2
    assert "is damaged: its val_history is" in capsys.readouterr().err


def test_a_run_stopped_at_an_evaluation_step_keeps_that_evaluation(tiny_run, tmp_path):
    """--eval-every 2, stopped at step 4 and resumed: the stopped run's final validation is step 4's
    evaluation, but it was kept nowhere (the loop leaves its last step's evaluation to the final
    validation, and the resumed run starts after it), so the resumed result lacked step 4's entry."""
    base = {**tiny_run, "steps": 6, "eval_every": 2}
    full = train(build_config(base))
    assert [e["step"] for e in full["val_history"]] == [2, 4]
    ckpt = tmp_path / "part.pt"
    half = train(build_config({**base, "stop_after": 4, "save": str(ckpt)}))
    assert half["val_history"] == full["val_history"] and half["val_loss"] == full["val_history"][1]["val_loss"]
    assert torch.load(ckpt, weights_only=True)["val_history"] == full["val_history"]
    resumed = train(build_config({**base, "resume": str(ckpt)}))
    assert resumed["val_history"] == full["val_history"] and resumed["val_loss"] == full["val_loss"]


def _logged_lrs(out) -> dict[int, float]:
    import json
    from pathlib import Path

    lines = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {d["step"]: d["lr"] for d in lines if "lr" in d}


def test_metrics_line_n_carries_the_lr_step_n_ran_at(tiny_run, tmp_path, monkeypatch):
    """Line N's ``lr`` is the learning rate the optimizer applied in step N (warm-up 2 of 6:
    half the peak at step 1, not the next step's), read from the optimizer as it steps."""
    applied: list[float] = []
    original = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        applied.append(float(self.param_groups[0]["lr"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    cfg = build_config({**tiny_run, "log_every": 1})
    train(cfg, log_metrics=True)
    lrs = _logged_lrs(Path(cfg.train.out))
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
    # The run's own six steps are the last six (a probe before the run may step a copy).
    assert [lrs[n] for n in range(1, 7)] == pytest.approx(applied[-6:], rel=1e-12)
    assert lrs[1] == pytest.approx(cfg.train.lr / 2, rel=1e-12)  # warm-up's first step


def test_resume_with_a_larger_steps_trains_the_same_run_longer(tiny_run, tmp_path):
    """A finished 12-step run resumed with --steps 30: the first 12 losses stay, 18 steps run,
    and every LR from the first resumed step on is the 30-step schedule's (the checkpoint's LR
    was the 12-step schedule's end, min_lr_ratio). The warm-up no setting named stays the one
    that ran (2 steps: 10% of 12), not 10% of 30, which would refuse the checkpoint."""
    base = {k: v for k, v in tiny_run.items() if k != "warmup_steps"}
    first = train(build_config({**base, "steps": 12, "save": str(tmp_path / "a.pt"), "out": str(tmp_path / "a")}))
    assert first["config"]["train"]["warmup_steps"] == 2
    cfg = build_config({**base, "steps": 30, "resume": str(tmp_path / "a.pt"), "out": str(tmp_path / "b")})
    assert cfg.train.warmup_steps == 3  # before the run: 10% of 30
    longer = train(cfg, log_metrics=True)  # metrics.jsonl: the LR of every step
    assert longer["steps_run"] == 18 and longer["loss_history"][:12] == first["loss_history"]
    assert longer["config"]["train"]["warmup_steps"] == 2
    new = lr_lambda(build_config({"steps": 30, "warmup_steps": 2}))
    lrs = _logged_lrs(tmp_path / "b")
    assert sorted(lrs) == list(range(13, 31))
    for step, lr in lrs.items():  # line N: the LR step N ran at (schedule index N - 1)
        assert lr == pytest.approx(cfg.train.lr * new(step - 1), rel=1e-12), step
    # The first resumed step's line is the new schedule's LR: the restored optimizer held the
    # 12-step schedule's end until the run took the step's LR again, as below.
    from conftest import tiny_run_state
    from memtrain.checkpoints.exact import load_checkpoint
    from memtrain.training.train import follow_new_schedule

    state = tiny_run_state(cfg)
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lr_lambda(cfg))
    load_checkpoint(str(tmp_path / "a.pt"), state)
    old_end = cfg.train.lr * lr_lambda(build_config({"steps": 12, "warmup_steps": 2}))(12)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(old_end, rel=1e-12)
    follow_new_schedule(state.scheduler)
    assert state.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.train.lr * new(12), rel=1e-12) != old_end


def test_a_crafted_checkpoints_negative_warmup_is_not_taken_by_a_longer_run(tiny_run, tmp_path):
    """A longer --steps adopts the saved warm-up only when it is a whole number >= 0: a crafted
    checkpoint's -3 would bypass --warmup-steps' own check. It is compared as any setting is,
    and refused before anything runs."""
    from memtrain.training.resume_check import check_resume, continue_longer

    base = {k: v for k, v in tiny_run.items() if k != "warmup_steps"}
    train(build_config({**base, "steps": 4, "save": str(tmp_path / "a.pt"), "out": str(tmp_path / "a")}))
    state = torch.load(tmp_path / "a.pt", weights_only=True)
    state["config"]["train"]["warmup_steps"] = -3
    torch.save(state, tmp_path / "crafted.pt")
    cfg = build_config({**base, "steps": 10, "resume": str(tmp_path / "crafted.pt"), "out": str(tmp_path / "b")})
    continue_longer(cfg)
    assert cfg.train.warmup_steps == 1  # 10% of 10, its own default
    with pytest.raises(ConfigError, match="warmup_steps: -3 -> 1"):
        check_resume(cfg)


def test_a_longer_steps_with_a_stop_after_past_the_saved_run_trains_to_the_stop(tiny_run, tmp_path):
    """``--resume CKPT --steps 10 --stop-after 7`` on a finished 4-step run: the 10-step run
    stops after step 7. The saved schedule, rebuilt to say where the LR moves, kept this run's
    --stop-after, and a 4-step schedule refused a stop at 7 (exit 2 naming ``--steps (4)``)."""
    base = {k: v for k, v in tiny_run.items() if k != "warmup_steps"}
    train(build_config({**base, "steps": 4, "save": str(tmp_path / "a.pt"), "out": str(tmp_path / "a")}))
    cfg = build_config({**base, "steps": 10, "stop_after": 7, "resume": str(tmp_path / "a.pt"),
                        "out": str(tmp_path / "b")})
    r = train(cfg)
    assert r["stopped_early"] and r["steps_run"] == 3 and len(r["loss_history"]) == 7


def _cli_train(capsys, *argv: str) -> tuple[int, str]:
    from memtrain.cli import main

    rc = main(["train", *argv])
    return rc, capsys.readouterr().err


def test_resume_alone_continues_the_run_with_its_saved_settings(tiny_run, tmp_path, capsys):
    """`train --resume CKPT` with no other flag: the checkpoint's saved settings (model, data,
    schedule, --out, --save) are the run's, so it ends as the uninterrupted run does; what the
    run stopped at (--stop-after) and the machine's settings are not taken from it."""
    from conftest import cli_flags

    base = {**tiny_run, "steps": 6, "dropout": 0.1}
    full = train(build_config({**base, "out": str(tmp_path / "full")}))
    ckpt = Path(tiny_run["out"]) / "half.pt"  # inside its --out: the checkpoint lends that folder
    rc, err = _cli_train(capsys, *cli_flags({**base, "stop_after": 3, "save": str(ckpt)}))
    assert rc == 0, err
    rc, err = _cli_train(capsys, "--resume", str(ckpt))
    assert rc == 0, err
    resumed = json.loads((Path(tiny_run["out"]) / "result.json").read_text())
    assert resumed["steps_run"] == 3 and resumed["loss_history"] == full["loss_history"]
    assert resumed["config"]["train"]["stop_after"] is None
    saved = torch.load(ckpt, weights_only=True)  # --save was the run's own: it holds the end now
    assert saved["step"] == 6
    # A flag still overrides, and one that changes the numbers is another run.
    rc, err = _cli_train(capsys, "--resume", str(ckpt), "--steps", "6", "--lr", "0.01")
    assert rc == 2 and "lr: 0.0003 -> 0.01" in err and "at step 6" not in err


def test_a_copied_or_moved_checkpoint_resumes_without_that_runs_out_and_save(tiny_run, tmp_path, capsys, monkeypatch):
    """A checkpoint that is no longer the file its run saved (an earlier one kept aside, one from
    another machine whose config names any folder) does not lend its --out and --save: taken,
    they replaced the run's newer checkpoint and wrote into that run's folder, or wherever a
    foreign config said. It writes where this run says, and a note names what was not taken."""
    import shutil

    from conftest import cli_flags

    base = {**tiny_run, "steps": 6}
    ckpt, run_out = tmp_path / "run" / "c.pt", tmp_path / "run"
    rc, err = _cli_train(capsys, *cli_flags({**base, "out": str(run_out), "save": str(ckpt), "stop_after": 2}))
    assert rc == 0, err
    kept = tmp_path / "kept.pt"
    shutil.copy(ckpt, kept)  # step 2, kept aside
    rc, err = _cli_train(capsys, "--resume", str(ckpt), "--stop-after", "4")  # the run goes on to step 4
    assert rc == 0, err
    assert "moved or copied" not in err  # its own checkpoint lends its outputs
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    # Outside its run's folder, it names no folder to write into: refused, as a checkpoint still at
    # its --save outside that folder is (it wrote into ./runs/train, a folder no one named).
    rc, err = _cli_train(capsys, "--resume", str(kept))
    assert rc == 2 and "add --out DIR" in err and len(err.strip().splitlines()) == 1, err
    assert list(here.iterdir()) == []
    rc, err = _cli_train(capsys, "--resume", str(kept), "--out", str(here / "b"))
    assert rc == 0, err
    assert f"was saved by its run as {str(ckpt)!r}" in err and "does not take that run's --save;" in err
    assert "saved no checkpoint" in err
    assert torch.load(ckpt, weights_only=True)["step"] == 4  # the run's newer checkpoint is left as it was
    assert json.loads((here / "b" / "result.json").read_text())["steps_run"] == 4
    rc, err = _cli_train(capsys, "--resume", str(kept), "--out", str(tmp_path / "branch"),
                         "--save", str(tmp_path / "branch.pt"))
    assert rc == 0 and "moved or copied" not in err, err  # both named: nothing to say
    assert torch.load(tmp_path / "branch.pt", weights_only=True)["step"] == 6


def test_resume_writes_where_the_user_said_or_into_the_checkpoints_own_run_folder(tiny_run, tmp_path, capsys,
                                                                                  monkeypatch):
    """One rule for where a resumed run writes, moved checkpoint or not: --out when given, else the
    folder the checkpoint lies in when its run wrote there, else refused. A checkpoint moved out of
    its folder resumed into ./runs/train (a default no one named) while one left at its --save
    outside its folder was refused; a copy kept inside its run's folder continues that folder."""
    import shutil

    from conftest import cli_flags

    run_out = tmp_path / "run"
    outside = tmp_path / "elsewhere.pt"  # saved outside its --out, still where its run saved it
    rc, err = _cli_train(capsys, *cli_flags({**tiny_run, "out": str(run_out), "save": str(outside), "stop_after": 2}))
    assert rc == 0, err
    inside = run_out / "kept.pt"
    shutil.copy(outside, inside)  # a copy kept in the run's own folder
    moved = tmp_path / "moved.pt"
    shutil.copy(outside, moved)  # and one moved away from it
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for ckpt in (outside, moved):
        rc, err = _cli_train(capsys, "--resume", str(ckpt))
        assert rc == 2 and "is not in the folder its run wrote to" in err and "add --out DIR" in err, err
    assert list(here.iterdir()) == []  # nothing written where no one said
    rc, err = _cli_train(capsys, "--resume", str(inside), "--stop-after", "4")
    assert rc == 0, err
    assert "does not take that run's --save" in err  # a copy: the run's own --save is left alone
    assert json.loads((run_out / "result.json").read_text())["steps_run"] == 2
    assert torch.load(outside, weights_only=True)["step"] == 2
    assert list(here.iterdir()) == []


def test_a_copied_checkpoint_of_a_run_that_saved_periodically_resumes(tiny_run, tmp_path, capsys):
    """A copied checkpoint lends no --save, and so no --save-every either: its run was refused
    with "--save-every 2 checkpoints to --save PATH, and no --save is given; ... or drop
    --save-every", a flag the user never gave."""
    import shutil

    from conftest import cli_flags

    base = {**tiny_run, "steps": 6}
    ckpt = tmp_path / "run" / "c.pt"
    rc, err = _cli_train(capsys, *cli_flags({**base, "out": str(tmp_path / "run"), "save": str(ckpt),
                                             "save_every": 2, "stop_after": 2}))
    assert rc == 0, err
    kept = tmp_path / "kept.pt"
    shutil.copy(ckpt, kept)
    rc, err = _cli_train(capsys, "--resume", str(kept), "--out", str(tmp_path / "branch"))
    assert rc == 0, err
    result = json.loads((tmp_path / "branch" / "result.json").read_text())
    assert result["steps_run"] == 4 and result["config"]["train"]["save_every"] == 0


def test_a_run_stopped_in_its_last_validation_resumes_to_its_result(tiny_run, tmp_path, monkeypatch):
    """With --save-every dividing --steps, the last step's periodic checkpoint was written before
    the final validation: Ctrl-C there left no result.json and a checkpoint at the last step, which
    --resume refused ("is at step 4, this run ends at step 4"). The last step saves only after
    result.json now. Where the failure's own save of the trained steps does not run (a sharded
    checkpoint, whose save is collective; stood in for here), the checkpoint stays at the last
    --save-every step, and the resumed run trains the last steps again and writes the result."""
    import memtrain.training.train as train_module

    base = {**tiny_run, "steps": 4, "warmup_steps": 1}
    full = train(build_config({**base, "out": str(tmp_path / "full")}))
    ckpt = tmp_path / "c.pt"
    real = train_module.evaluate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "evaluate", interrupted)
    monkeypatch.setattr(train_module, "_save_trained_steps", lambda *args: None)
    with pytest.raises(KeyboardInterrupt):
        train(build_config({**base, "save": str(ckpt), "save_every": 2, "out": str(tmp_path / "a")}))
    assert torch.load(ckpt, weights_only=True)["step"] == 2
    monkeypatch.setattr(train_module, "evaluate", real)
    resumed = train(build_config({**base, "save": str(ckpt), "save_every": 2, "resume": str(ckpt),
                                  "out": str(tmp_path / "b")}))
    assert resumed["loss_history"] == full["loss_history"] and resumed["val_loss"] == full["val_loss"]


def test_a_checkpoint_outside_its_runs_out_folder_does_not_name_where_the_resume_writes(tiny_run, tmp_path, capsys):
    """A checkpoint still at its --save, but outside the --out its config names (a file anyone
    could place at a known path, naming any folder), does not lend that --out: `--resume CKPT`
    alone is one line asking for --out, and nothing is written in the folder it named; with
    --out (flag or config file) it resumes there, its own --save kept."""
    from conftest import cli_flags

    base = {**tiny_run, "steps": 6}
    victim, ckpt = tmp_path / "victim", tmp_path / "shared" / "c.pt"
    victim.mkdir(), ckpt.parent.mkdir()
    (victim / "notes.txt").write_text("mine")
    rc, err = _cli_train(capsys, *cli_flags({**base, "out": str(victim), "save": str(ckpt), "stop_after": 2}))
    assert rc == 0, err
    def files() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in victim.iterdir()}

    before = files()
    rc, err = _cli_train(capsys, "--resume", str(ckpt))
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error:") and "add --out DIR" in err, err
    assert files() == before  # nothing written where it named
    assert torch.load(ckpt, weights_only=True)["step"] == 2
    rc, err = _cli_train(capsys, "--resume", str(ckpt), "--out", str(tmp_path / "mine"), "--stop-after", "4")
    assert rc == 0, err
    assert json.loads((tmp_path / "mine" / "result.json").read_text())["steps_run"] == 2
    assert torch.load(ckpt, weights_only=True)["step"] == 4  # its own --save goes on
    assert files() == before


def test_a_checkpoint_lends_only_the_folder_it_lies_in(tmp_path):
    """Not a folder above it (a crafted config naming `/` or the home folder would otherwise pass),
    nor the folder above its own."""
    from memtrain.training.resume_check import lends_out

    out = tmp_path / "run"
    (out / "sub").mkdir(parents=True)
    assert lends_out(out / "c.pt", str(out)) and lends_out(out / "c.pt", str(out) + "/")
    assert not lends_out(out / "sub" / "c.pt", str(out))
    assert not lends_out(out / "c.pt", str(tmp_path)) and not lends_out(out / "c.pt", "/")
    assert not lends_out(out / "c.pt", "") and not lends_out(out / "c.pt", None)


def test_resume_from_another_folder_continues_in_the_runs_own_folder(tiny_run, tmp_path, capsys, monkeypatch):
    """Relative --data, --out and --save are relative to where the run was launched: resumed
    from another working folder (by the checkpoint's path alone) the run continues in its own
    --out and --save and reads its own data, rather than starting a copy beside the new folder
    and refusing the data path; `./d.jsonl` and `d.jsonl` are one file. A checkpoint that
    records no launch folder (an older one) is placed by its relative --save."""
    import shutil

    from conftest import cli_flags

    base = {**tiny_run, "steps": 6}
    full = train(build_config({**base, "out": str(tmp_path / "full")}))
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir(), elsewhere.mkdir()
    shutil.copy(tiny_run["data"], home / "d.jsonl")
    monkeypatch.chdir(home)
    rel = {**base, "data": "d.jsonl", "out": "runs/x", "save": "runs/x/c.pt"}
    rc, err = _cli_train(capsys, *cli_flags({**rel, "stop_after": 2}))
    assert rc == 0, err
    ckpt = home / "runs" / "x" / "c.pt"
    assert torch.load(ckpt, weights_only=True)["cwd"] == str(home)
    rc, err = _cli_train(capsys, "--resume", "runs/x/c.pt", "--data", "./d.jsonl", "--stop-after", "4")
    assert rc == 0, err
    state = torch.load(ckpt, weights_only=True)
    assert state["step"] == 4
    del state["cwd"]  # as an older memtrain wrote it
    torch.save(state, ckpt)
    monkeypatch.chdir(elsewhere)
    rc, err = _cli_train(capsys, "--resume", str(ckpt))
    assert rc == 0, err
    assert list(elsewhere.iterdir()) == []  # nothing started beside the new working folder
    resumed = json.loads((home / "runs" / "x" / "result.json").read_text())
    assert resumed["loss_history"] == full["loss_history"] and torch.load(ckpt, weights_only=True)["step"] == 6


def test_a_run_folder_moved_with_its_checkpoint_resumes_and_exports_from_the_new_place(small_corpus, tmp_path, capsys,
                                                                                       monkeypatch):
    """A run launched in proj/ with relative --model, --data, --out and --save, then the folder
    renamed (proj -> moved): its paths were anchored to the launch folder the checkpoint records,
    which no longer exists. export could not find the --model folder ("is not a preset, a
    bundled config ..."), nor could a resume. The checkpoint's own relative --save places the
    run now: export reads moved/llama, and the resume continues in moved/runs/x, recreating
    nothing at the old place."""
    import shutil

    from conftest import cli_flags
    from memtrain.cli import main

    proj = tmp_path / "proj"
    (proj / "llama").mkdir(parents=True)
    bundled = Path(__file__).resolve().parents[1] / "src" / "memtrain" / "models" / "configs" / "tiny-llama.json"
    shutil.copy(bundled, proj / "llama" / "config.json")
    shutil.copy(small_corpus, proj / "d.jsonl")
    monkeypatch.chdir(proj)
    rel = {"model": "llama", "data": "d.jsonl", "out": "runs/x", "save": "runs/x/c.pt", "seq_len": 16,
           "batch_size": 1, "steps": 3, "warmup_steps": 1, "val_blocks": 1, "progress": False}
    rc, err = _cli_train(capsys, *cli_flags({**rel, "stop_after": 1}))
    assert rc == 0, err
    proj.rename(tmp_path / "moved")
    monkeypatch.chdir(tmp_path)
    assert main(["export", "moved/runs/x/c.pt", "exported"]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["model_type"] == "llama"
    rc, err = _cli_train(capsys, "--resume", "moved/runs/x/c.pt", "--stop-after", "2")
    assert rc == 0, err
    assert torch.load(tmp_path / "moved" / "runs" / "x" / "c.pt", weights_only=True)["step"] == 2
    assert json.loads((tmp_path / "moved" / "runs" / "x" / "result.json").read_text())["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "moved"]


def test_a_changed_flag_on_resume_is_said_as_the_resumes_difference(tiny_run, tmp_path, capsys):
    """`--resume CKPT --lr X` where CKPT is the run's own --save: the line names the lr, in a
    resume's words (not "choose a new --save", which would only move the refusal), and a larger
    --steps, which is allowed, is not listed as a difference."""
    from conftest import cli_flags

    ckpt = Path(tiny_run["out"]) / "c.pt"  # inside its --out, which it lends
    rc, err = _cli_train(capsys, *cli_flags({**tiny_run, "steps": 6, "stop_after": 2, "save": str(ckpt)}))
    assert rc == 0, err
    rc, err = _cli_train(capsys, "--resume", str(ckpt), "--lr", "0.01", "--steps", "8")
    assert rc == 2 and "lr: 0.0003 -> 0.01" in err and "--resume alone takes the saved run's settings" in err
    assert "choose a new --save" not in err and "steps:" not in err


def test_resume_compares_the_data_by_content_not_by_path(tiny_run, tmp_path, capsys):
    """A copy of the data at another path resumes (into the run's own --out, whose result.json
    records the original path); other content at another path is another run's, named."""
    import shutil

    from conftest import cli_flags

    ckpt = Path(tiny_run["out"]) / "c.pt"
    rc, err = _cli_train(capsys, *cli_flags({**tiny_run, "steps": 6, "stop_after": 2, "save": str(ckpt)}))
    assert rc == 0, err
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "quite other words"}\n' * 50)
    rc, err = _cli_train(capsys, "--resume", str(ckpt), "--data", str(other))
    assert rc == 2 and "different run" in err and "data: " in err
    copy = tmp_path / "copy.jsonl"
    shutil.copy(tiny_run["data"], copy)
    rc, err = _cli_train(capsys, "--resume", str(ckpt), "--data", str(copy))
    assert rc == 0, err
    assert torch.load(ckpt, weights_only=True)["step"] == 6


def test_a_checkpoint_whose_saved_settings_are_refused_names_it(tiny_run, tmp_path, capsys):
    train(build_config({**tiny_run, "steps": 2, "save": str(tmp_path / "a.pt")}))
    state = torch.load(tmp_path / "a.pt", weights_only=True)
    state["config"]["train"]["lr"] = -1.0
    state["config"]["model"]["unheard_of"] = 3  # a name this memtrain does not know: left out
    torch.save(state, tmp_path / "crafted.pt")
    rc, err = _cli_train(capsys, "--resume", str(tmp_path / "crafted.pt"))
    assert rc == 2 and err.count("\n") == 1
    assert f"checkpoint {str(tmp_path / 'crafted.pt')!r} holds settings memtrain refuses" in err and "lr" in err


def test_a_checkpoint_whose_saved_config_has_a_key_that_is_no_name_is_refused(tiny_run, tmp_path, capsys):
    """torch.load admits any dict key: an integer key in the saved config (a crafted file)
    ended `--resume` and export with exit 1 (AttributeError in flatten)."""
    from memtrain.inference.export import read_checkpoint

    config = build_config(tiny_run).to_dict()
    config["train"][5] = 1
    torch.save({"config": config, "step": 0, "model": {}}, tmp_path / "crafted.pt")
    rc, err = _cli_train(capsys, "--resume", str(tmp_path / "crafted.pt"))
    assert rc == 2 and err.count("\n") == 1 and "the key 5 is not a setting name" in err, err
    with pytest.raises(ConfigError, match="the key 5 is not a setting name"):
        read_checkpoint(tmp_path / "crafted.pt")


@pytest.mark.parametrize("world", [None, -2, "two"])
def test_a_sharded_checkpoint_without_a_rank_count_is_damaged(tmp_path, capsys, world):
    """A meta.json without a positive world_size was answered "written by None ranks; resume
    with --nproc-per-node None"."""
    import json

    meta = {"config": {}, "step": 0, **({} if world is None else {"world_size": world})}
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
    rc, err = _cli_train(capsys, "--resume", str(tmp_path / "ck"))
    assert rc == 2 and err.count("\n") == 1, err
    assert f"is damaged: its meta.json's world_size is {world!r}, not a count of ranks" in err, err


def test_resume_rejects_other_model(tiny_run, tmp_path):
    train(build_config({**tiny_run, "steps": 2, "save": str(tmp_path / "a.pt")}))
    with pytest.raises(ConfigError, match="does not fit this model"):
        train(build_config({**tiny_run, "d_model": 64, "resume": str(tmp_path / "a.pt")}))
    bad = tmp_path / "junk.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot read checkpoint"):
        train(build_config({**tiny_run, "resume": str(bad)}))


def test_grad_accum_counts_tokens(tiny_run):
    r = train(build_config({**tiny_run, "steps": 3, "grad_accum": 2}))
    assert r["tokens"] == 3 * 2 * 4 * 32


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no optimizer step here
def test_metrics_line_holds_plain_numbers_when_a_tensor_comes_back():
    """torchao's optimizers keep the learning rate as a 0-d tensor: the metrics.jsonl line
    must still be written (it stopped a bf16-pure run on an H100 at its first line), and the
    value logged is the one at the step, though the scheduler overwrites the tensor in place."""
    import json

    ao = pytest.importorskip("torchao.optim")
    from memtrain.training.train import _host_scalars, _step_scalars, step_lr

    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    sched = torch.optim.lr_scheduler.LambdaLR(ao._AdamW([p], lr=3e-4, bf16_stochastic_round=True), lambda s: 0.5 ** s)
    assert isinstance(sched.get_last_lr()[0], torch.Tensor)  # what made the line unwritable
    logged = _host_scalars(step_lr(sched), torch.device("cpu"))
    sched.step()  # the next step, queued before this one's line is written
    out = _step_scalars(2.25, logged, 1.5, 100.0)
    line = json.loads(json.dumps(out))
    assert line["loss"] == 2.25 and abs(line["lr"] - 3e-4) < 1e-9 and line["grad_norm"] == 1.5
    assert abs(float(sched.get_last_lr()[0]) - 1.5e-4) < 1e-9


# Settings that change the numbers a run computes: a checkpoint saved under another value of any
# of them is another run's (a resumed run would not continue it exactly).
DECIDES_THE_NUMBERS = {
    "lr": 1e-3, "seed": 7, "grad_accum": 2, "grad_clip": 0.5, "weight_decay": 0.0, "beta1": 0.8, "beta2": 0.99,
    "dropout": 0.0, "precision": "bf16", "optim": "sgd", "lora_rank": 4, "batch_size": 3, "seq_len": 32,
    "min_lr_ratio": 0.0, "schedule": "constant", "warmup_steps": 5, "steps": 20, "d_model": 128,
    "val_fraction": 0.2, "split_seed": 9, "window": 8,
}


@pytest.mark.parametrize("key", list(DECIDES_THE_NUMBERS))
def test_a_checkpoint_of_a_run_that_differs_in_a_number_deciding_setting_is_refused(key):
    from memtrain.training.resume_check import config_differences

    base = {"steps": 10, "warmup_steps": 1, "seq_len": 64}
    saved = build_config(base).to_dict()
    now = build_config({**base, key: DECIDES_THE_NUMBERS[key]}).to_dict()
    diffs = config_differences(saved, now)
    assert any(d.startswith(f"{key}: ") for d in diffs), diffs
    assert config_differences(saved, build_config({**base, "out": "elsewhere", "attention": "sdpa"}).to_dict()) == []


def test_a_resumed_runs_train_loss_mean_covers_the_steps_it_ran(tiny_run, tmp_path):
    """train_loss_mean is the Trainer's train_loss: the mean over the steps this invocation ran,
    so a run stopped at 3 of 6 and resumed averages steps 4-6, not the whole loss history."""
    base = {**tiny_run, "steps": 6}
    ckpt = tmp_path / "part.pt"
    train(build_config({**base, "stop_after": 3, "save": str(ckpt)}))
    resumed = train(build_config({**base, "resume": str(ckpt)}))
    history = resumed["loss_history"]
    assert len(history) == 6 and resumed["steps_run"] == 3
    assert resumed["train_loss_mean"] == pytest.approx(sum(history[3:]) / 3)
    assert resumed["train_loss_mean"] != pytest.approx(sum(history) / 6)
