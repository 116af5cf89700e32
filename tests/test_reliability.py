"""What memtrain promises a careless or hostile user (docs/reliability.md), one class per test:
nothing read executes code, nothing produced is lost, resume refuses another run, nonsense is
refused with exit 2 and one ``error:`` line, and the token cache heals itself."""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TINY_MODEL, cli_flags, tiny_run_state
from memtrain.cli import main
from memtrain.config.run import ConfigError, RunConfig, build_config
from memtrain.training.resume_check import config_differences

RUN = {"seq_len": 32, "warmup_steps": 1, "val_blocks": 2, "warmup_timing_steps": 1, "batch_size": 2}



def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    return lines[0]


class _TouchFile:
    """A pickle that, when loaded by plain pickle, creates a file (the audit's repro used os.system)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


# --------------------------------------------------------------------------- 1. nothing executed


def _run_state(cfg):
    return tiny_run_state(cfg, batch_index=3)


def _crafted_dcp(root: Path, marker: Path, settings: dict | None = None) -> Path:
    """A sharded checkpoint whose meta.json matches the run (an attacker can copy a config)
    and whose .metadata is a pickle that creates ``marker`` when unpickled."""
    ckpt = root / "evil"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_TouchFile(marker)))
    (ckpt / "meta.json").write_text(json.dumps({
        "format": "memtrain-dcp-1", "step": 2, "losses": [1.0, 1.0], "loader": {"epoch": 0, "batch_index": 2},
        "world_size": 1, "strategy": "ddp",
        "config": build_config(settings or {**TINY_MODEL, **RUN, "steps": 4}).to_dict()}))
    return ckpt


def test_crafted_dcp_metadata_is_refused_and_nothing_runs(one_rank_group, tmp_path):
    from memtrain.checkpoints.distributed import load_checkpoint

    marker = tmp_path / "touched"
    ckpt = _crafted_dcp(tmp_path, marker)
    cfg = build_config({**TINY_MODEL, **RUN, "steps": 4})
    with pytest.raises(ConfigError, match="is refused: its .metadata is not a plain DCP metadata file"):
        load_checkpoint(ckpt, _run_state(cfg))
    assert not marker.exists()
    # torch's own reader runs it (here harmlessly: it creates the marker): the threat is real.
    import torch.distributed.checkpoint as dcp

    with pytest.raises(Exception):  # noqa: B017 - any failure of torch's reader will do; the marker is the check
        dcp.FileSystemReader(str(ckpt)).read_metadata()
    assert marker.exists()


def test_safe_planner_refuses_a_pickled_byte_item(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from memtrain.checkpoints.safe_dcp import SafeLoadPlanner

    marker = tmp_path / "touched"
    buf = io.BytesIO()
    torch.save({"x": _TouchFile(marker)}, buf)
    buf.seek(0)
    planner = SafeLoadPlanner(flatten_state_dict=False)
    planner.state_dict = {}
    item = ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex("x"), dest_offsets=torch.Size([0]),
                    storage_index=MetadataIndex("x"), storage_offsets=torch.Size([0]), lengths=torch.Size([0]))
    with pytest.raises(pickle.UnpicklingError):
        planner.load_bytes(item, buf)
    assert not marker.exists()


def test_sharded_checkpoint_round_trips_through_the_safe_reader(one_rank_group, tmp_path):
    from memtrain.checkpoints.distributed import load_checkpoint, save_checkpoint

    cfg = build_config({**TINY_MODEL, **RUN, "steps": 4, "distributed": "ddp"})
    run = _run_state(cfg)
    model, opt, loader = run.model, run.optimizer, run.loader
    x = torch.randint(0, cfg.model.vocab_size, (2, 16))
    model(x, x).backward()
    opt.step()
    run.step, run.losses = 1, [3.0]
    save_checkpoint(tmp_path / "ck", run)
    run2 = _run_state(cfg)
    model2, opt2, loader2 = run2.model, run2.optimizer, run2.loader
    loader2.state = {}
    state = load_checkpoint(tmp_path / "ck", run2)
    assert state == {"step": 1, "losses": [3.0]} and loader2.state == loader.state
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"][0]["lr"] == s2["param_groups"][0]["lr"]
    assert torch.equal(s1["state"][0]["exp_avg"], s2["state"][0]["exp_avg"])


def test_a_sharded_save_stopped_while_it_replaces_the_last_one_keeps_a_checkpoint_at_its_path(one_rank_group,
                                                                                              tmp_path, monkeypatch):
    """The replacing save moved the previous checkpoint aside, then the new one in: a rank killed
    between the two renames (SIGKILL; SIGTERM ends a rank at once under torch's launcher) left
    nothing at --save, and --resume said it was no checkpoint. The names are now swapped in one
    step: stopped at the same point (as the new folder would take the name), the path still holds a
    whole checkpoint, and an uninterrupted save replaces it."""
    from memtrain.checkpoints.distributed import load_checkpoint, save_checkpoint

    cfg = build_config({**TINY_MODEL, **RUN, "steps": 4, "distributed": "ddp"})
    run = _run_state(cfg)
    run.step, run.losses = 1, [3.0]
    save_checkpoint(tmp_path / "ck", run)
    run.step, run.losses = 2, [3.0, 2.0]

    rename = Path.rename

    def killed(self, target):  # DCP renames its own files; this is the new folder taking ck's name
        if self.name == ".ck.tmp" and Path(target).name == "ck":
            raise KeyboardInterrupt("the rank is killed here")
        return rename(self, target)

    with monkeypatch.context() as m:
        m.setattr(Path, "rename", killed)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(tmp_path / "ck", run)
            raise KeyboardInterrupt("no rename: the swap was one step")  # where the system swaps names
    assert load_checkpoint(tmp_path / "ck", _run_state(cfg))["step"] in (1, 2)
    save_checkpoint(tmp_path / "ck", run)
    assert load_checkpoint(tmp_path / "ck", _run_state(cfg))["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ck")) == []


def test_torchrun_resume_of_a_crafted_checkpoint_exits_2_without_running_it(small_corpus, tmp_path):
    marker = tmp_path / "touched"
    run = {**TINY_MODEL, **RUN, "steps": 4, "data": str(small_corpus), "progress": False, "distributed": "ddp"}
    ckpt = _crafted_dcp(tmp_path, marker, run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m", "memtrain",
           "train", *cli_flags({**run, "resume": str(ckpt), "out": str(tmp_path / "out")})]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(tmp_path / "cache")})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is refused" in errors[0], proc.stderr[-3000:]
    assert "exitcode  : 2" in proc.stderr  # the rank's own exit code, as torchrun reports it
    assert not marker.exists() and not (tmp_path / "out" / "result.json").exists()


# --------------------------------------------------------------------------- 3. nothing lost
def test_unwritable_destinations_fail_before_the_first_step(tiny_run, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for extra, words in [({"save": str(tmp_path)}, "is a directory"),
                         ({"out": str(tmp_path / "file")}, "is a file"),
                         ({"out": str(tmp_path / "file" / "sub")}, "cannot be created"),
                         ({"save": str(tmp_path / "file" / "ck.pt")}, "(its folder)")]:
        assert main(["train", *cli_flags({**tiny_run, **extra})]) == 2
        assert words in _one_error_line(capsys.readouterr().err)
    assert not Path(tiny_run["out"]).exists()  # refused before anything was written


def test_disk_full_at_the_final_save_keeps_result_and_previous_checkpoint(tiny_run, tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck.pt"
    run = {**tiny_run, "steps": 2, "save": str(ck)}
    assert main(["train", *cli_flags(run)]) == 0
    before = ck.read_bytes()
    (Path(tiny_run["out"]) / "result.json").unlink()
    (Path(tiny_run["out"]) / "metrics.jsonl").unlink()  # a fresh run refuses a folder holding a curve
    capsys.readouterr()

    def full_disk(obj, f, *a, **kw):
        f.write(b"half a checkpoint")  # torch.save gets the file memtrain opened
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("memtrain.checkpoints.exact.torch.save", full_disk)
    assert main(["train", *cli_flags(run)]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: disk full") and str(ck) in line
    assert ck.read_bytes() == before  # the previous checkpoint is intact
    assert json.loads((Path(tiny_run["out"]) / "result.json").read_text())["steps"] == 2  # written first
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ck.pt")) == ["ck.pt"]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_loss_stops_the_run_and_writes_no_nan(tiny_run, capsys, monkeypatch, value):
    monkeypatch.setattr("memtrain.training.step.train_step", lambda *a, **kw: float(value))
    assert main(["train", *cli_flags(tiny_run)]) == 1
    assert f"the training loss became {value} at step 1" in _one_error_line(capsys.readouterr().err)
    assert not (Path(tiny_run["out"]) / "result.json").exists()


# --------------------------------------------------------------------------- 4. torn results lines
def test_bench_appends_after_a_torn_line_and_reports_partial(small_corpus, tmp_path, capsys):
    from memtrain.bench.runner import BenchOptions, bench_settings, config_hash, resolve_rows, settings_hash

    overrides = {**TINY_MODEL, "data": str(small_corpus), "steps": 2, "warmup_steps": 1, "batch_size": 2,
                 "seq_len": 32, "val_blocks": 2}
    opts = BenchOptions(techniques=["baseline"], overrides=overrides, maxbatch=False)
    (name, cfg), = resolve_rows(opts)
    done = {"technique": "baseline", "status": "ok", "config_hash": config_hash(cfg.to_dict()),
            "settings_hash": settings_hash(bench_settings(opts)),
            "config": cfg.to_dict(), "val_ppl": 10.0, "step_time_s": {"median": 0.01},
            "memory": {"peak_bytes": 1000}}
    out = tmp_path / "b"
    out.mkdir()
    (out / "results.jsonl").write_text("[1]\n" + json.dumps(done) + '\n{"technique": "x", "stat')
    # baseline is done (skipped); the invalid row runs and must land on a line of its own.
    assert main(["bench", "--techniques", "baseline,attention=flex", "--out", str(out), "--no-maxbatch",
                 *cli_flags({**overrides, "progress": False})]) == 1
    err = capsys.readouterr().err
    assert "skipped 2 unreadable line(s)" in err
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[-1])["technique"] == "attention=flex"
    assert json.loads(lines[1])["technique"] == "baseline" and lines[2] == '{"technique": "x", "stat'


# --------------------------------------------------------------------------- 5. resume refuses another run
@pytest.fixture(scope="module")
def saved_run(small_corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    run = {**TINY_MODEL, **RUN, "data": str(small_corpus), "steps": 6, "stop_after": 3, "progress": False,
           "save": str(root / "half.pt"), "out": str(root / "half")}
    assert main(["train", *cli_flags(run)]) == 0
    return run, root


@pytest.mark.parametrize("change, key", [
    ({"d_model": 64}, "d_model"), ({"n_layers": 3}, "n_layers"), ({"batch_size": 4}, "batch_size"),
    ({"seq_len": 16}, "seq_len"), ({"grad_accum": 2}, "grad_accum"), ({"steps": 4}, "steps"),
    ({"schedule": "constant"}, "schedule"), ({"seed": 1}, "seed"), ({"optim": "sgd"}, "optim"),
    ({"lr": 1e-3}, "lr"), ({"val_fraction": 0.1}, "val_fraction"), ({"data": "default"}, "data"),
])
def test_resume_with_a_changed_key_is_refused_naming_it(saved_run, change, key, capsys):
    run, root = saved_run
    resumed = {**run, "stop_after": None, "save": None, "resume": str(root / "half.pt"), "out": str(root / "r"), **change}
    args = cli_flags({k: v for k, v in resumed.items() if v is not None})
    assert main(["train", *args]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "different run" in line and f"{key}:" in line
    assert not (root / "r").exists()


def test_resume_with_a_larger_steps_trains_longer_and_says_what_the_lr_does(saved_run, tmp_path, capsys):
    """A larger --steps is the same run trained longer (a smaller one is another run, above):
    it finishes, and one stderr note says the schedule now spans the new --steps and where the
    LR moves. A warm-up set apart from the saved one is still another run's."""
    run, root = saved_run
    resumed = {**run, "stop_after": None, "save": str(tmp_path / "end.pt"), "resume": str(root / "half.pt"),
               "out": str(tmp_path / "r"), "steps": 10}
    assert main(["train", *cli_flags({k: v for k, v in resumed.items() if v is not None})]) == 0
    err = capsys.readouterr().err
    assert "--steps 10 trains the 6-step run" in err and "schedule now spans 10 steps" in err
    assert "LR at step 3 moves from" in err, err
    assert json.loads((tmp_path / "r" / "result.json").read_text())["steps_run"] == 7
    # Resuming the finished run at its own --steps: nothing to run; the line says how to go on.
    again = {**resumed, "save": None, "resume": str(tmp_path / "end.pt"), "out": str(tmp_path / "r2")}
    assert main(["train", *cli_flags({k: v for k, v in again.items() if v is not None})]) == 2
    assert "give a larger --steps" in _one_error_line(capsys.readouterr().err)
    other = {**resumed, "save": None, "out": str(tmp_path / "r3"), "warmup_steps": 2}
    assert main(["train", *cli_flags({k: v for k, v in other.items() if v is not None})]) == 2
    assert "warmup_steps: 1 -> 2" in _one_error_line(capsys.readouterr().err)
    # In the shorter run's own folder, saving over its own checkpoint: its files, so continued.
    shutil.copytree(root / "half", tmp_path / "own")
    shutil.copy(root / "half.pt", tmp_path / "own.pt")
    own = {**resumed, "save": str(tmp_path / "own.pt"), "resume": str(tmp_path / "own.pt"), "out": str(tmp_path / "own")}
    assert main(["train", *cli_flags({k: v for k, v in own.items() if v is not None})]) == 0
    assert json.loads((tmp_path / "own" / "result.json").read_text())["config"]["train"]["steps"] == 10


def test_resume_with_other_logging_options_continues_the_run(saved_run, tmp_path):
    run, root = saved_run
    # A --save of its own: the saved run's (the shared half.pt) would be this run's otherwise.
    resumed = {**run, "stop_after": None, "save": str(tmp_path / "end.pt"), "resume": str(root / "half.pt"),
               "out": str(tmp_path / "r"), "log_every": 2}
    assert main(["train", *cli_flags({k: v for k, v in resumed.items() if v is not None})]) == 0
    # Where metrics go is no more part of the run than how often they are written.
    saved = RunConfig().to_dict()
    now = RunConfig().to_dict()
    now["train"].update(report_to="tensorboard", log_every=5, progress=False)
    assert config_differences(saved, now) == []


def test_resume_outside_the_run_and_incomplete_checkpoints_are_refused(saved_run, tmp_path, capsys):
    run, root = saved_run
    base = {**run, "save": None, "resume": str(root / "half.pt"), "out": str(tmp_path / "r")}
    assert main(["train", *cli_flags({**base, "stop_after": 2})]) == 2  # saved at step 3: steps_run would be -1
    assert "is at step 3" in _one_error_line(capsys.readouterr().err)
    state = torch.load(root / "half.pt", weights_only=True)
    del state["model"]
    torch.save(state, tmp_path / "nomodel.pt")
    no_model = {k: v for k, v in base.items() if k != "stop_after"}
    assert main(["train", *cli_flags({**no_model, "resume": str(tmp_path / "nomodel.pt")})]) == 2
    assert "lacks model" in _one_error_line(capsys.readouterr().err)


# --------------------------------------------------------------------------- 7/8. exit-code contract
@pytest.mark.parametrize("args, words", [
    (["--seed", "-1"], "--seed"), (["--beta1", "1.5"], "--beta1"), (["--lr", "inf"], "--lr"),
    (["--lr", "1e30"], "--lr"), (["--lr", "nan"], "--lr"), (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--eval-every", "-1"], "--eval-every"), (["--save-every", "-1"], "--save-every"), (["--out", ""], "--out"),
    (["--vocab-size", "100"], "--vocab-size 100"), (["--steps", "inf"], "--steps"),
    # An empty path would mean the current folder: every data file under it, the cache beside them.
    (["--data", ""], "--data is empty"), (["--data", "  "], "--data is empty"),
    (["--cache-dir", ""], "--cache-dir is empty"),
    # A source setting --data does not use: the run trained on the default corpus, or on every line.
    (["--data", "default", "--text-field", "body"], "--text-field body names a field of a structured --data"),
    (["--data", "notes.txt", "--text-field", "body"], "--data notes.txt is plain text"),
    (["--hf-split", "test"], "--hf-split test picks a split of an hf: --data"),
    (["--warmup-steps", "7"], "--warmup-steps 7 is longer than --steps 6"),
])
def test_nonsense_flags_are_refused_before_anything_runs(tiny_run, args, words, capsys):
    assert main(["train", *cli_flags(tiny_run), *args]) == 2
    assert words in _one_error_line(capsys.readouterr().err)
    assert not Path(tiny_run["out"]).exists()


@pytest.mark.parametrize("name, content, words", [
    ("list.yaml", b"- 1\n- 2\n", "holds a list"),
    ("str.yaml", b"hello\n", "holds a str"),
    ("null.yaml", b"d_model: null\n", "--d-model expects int, got null"),
    ("intkey.yaml", b"1: 2\n", "has the key 1"),
    ("latin1.toml", b'data = "caf\xe9"\n', "not UTF-8"),
    ("bool.toml", b"batch_size = true\n", "--batch-size expects int, got True"),
    ("nested.yaml", b"model: {d_model: [1]}\n", "--d-model expects int, got a list"),
    # A key given twice: YAML and JSON parsers keep the later one silently (a second section
    # replaced the first whole); TOML refuses it itself.
    ("twice.yaml", b"steps: 3\nsteps: 5\n", "the key 'steps' appears twice (line 2)"),
    ("section_twice.yaml", b"train:\n  steps: 3\ntrain:\n  lr: 0.1\n", "the key 'train' appears twice (line 3)"),
    ("twice.json", b'{"steps": 3, "steps": 5}', "the key 'steps' appears twice"),
    ("twice.toml", b"steps = 3\nsteps = 5\n", "cannot parse config file"),
])
def test_bad_config_files_are_refused(tiny_run, tmp_path, name, content, words, capsys):
    (tmp_path / name).write_bytes(content)
    assert main(["train", "--config", str(tmp_path / name), *cli_flags(tiny_run)]) == 2
    assert words in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("verb", ["estimate", "maxbatch", "flops"])
def test_an_infinite_seq_len_in_a_config_file_is_one_line(tmp_path, capsys, verb):
    """YAML's .inf as --seq-len: the verbs whose --max-seq-len follows --seq-len converted it to
    an int before the config was checked (OverflowError, exit 1)."""
    (tmp_path / "c.yaml").write_text("seq_len: .inf\n")
    assert main([verb, "--config", str(tmp_path / "c.yaml")]) == 2
    assert "--seq-len expects int, got inf" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("verb, text, flag", [
    ("maxbatch", "memory_budget: 4GiB\n", "--memory-budget"),
    ("plan", "train:\n  memory_budget: 4GiB\ntop: 3\n", "--memory-budget"),
    ("estimate", "seq_len: 32\nbudget: 4GiB\n", "--budget"),
])
def test_a_commands_own_option_in_a_config_file_is_named_as_one(tmp_path, capsys, verb, text, flag):
    """A config file holds run settings; a command's own option there (maxbatch's memory_budget)
    was refused as "unknown option --memory-budget; did you mean --compile-memory-budget?",
    though the command's --help lists it. The line names the file and says to give the flag."""
    (tmp_path / "c.yaml").write_text(text)
    assert main([verb, "--config", str(tmp_path / "c.yaml")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"config file {str(tmp_path / 'c.yaml')!r}" in line and "is an option of this command" in line, line
    assert f"give {flag} on the command line" in line and "--compile-memory-budget" not in line, line


@pytest.mark.parametrize("text, named", [("train:\n  stepz: 3\n", "unknown option --stepz; did you mean --steps?"),
                                         ("learning_rat: 0.1\n", "did you mean --learning-rate?"),
                                         ("foo: 1\n", "unknown option --foo; see --help")])
def test_an_unknown_key_in_a_config_file_names_the_file(tmp_path, capsys, text, named):
    """A key no section has read "unknown option --foo", the words of a mistyped flag: the user
    could not tell the file held it. The line names the file; a flag still reads as before."""
    (tmp_path / "c.yaml").write_text(text)
    out = tmp_path / "out"
    assert main(["train", "--config", str(tmp_path / "c.yaml"), "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: config file {str(tmp_path / 'c.yaml')!r}: ") and named in line, line
    assert not out.exists()


def test_empty_data_file_and_command_counts_are_refused(tiny_run, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["train", *cli_flags({**tiny_run, "data": str(tmp_path / "empty.jsonl")})]) == 2
    assert "is empty" in _one_error_line(capsys.readouterr().err)
    for argv in (["bench", "--row-timeout", "0"], ["bench", "--max-batch", "-3"], ["maxbatch", "--max", "-5"],
                 ["plan", "--verify-steps", "0"]):
        with pytest.raises(SystemExit) as exc:  # argparse's one error line
            main(argv)
        assert exc.value.code == 2, argv
        _one_error_line(capsys.readouterr().err)
    # A bench row's own key and the same global flag: refused, neither silently wins.
    assert main(["bench", "--techniques", "steps=5", "--steps", "10", "--out", str(tmp_path / "b")]) == 2
    assert "sets steps and --steps is given too" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- 9. the token cache heals
def _entry(cfg) -> Path:
    from memtrain.data.cache import cache_key, cache_root

    return cache_root(cfg.data) / cache_key(cfg.data)


@pytest.mark.parametrize("plant", ["fifo-meta", "fifo-bin", "zero-meta", "zero-bin", "huge-meta", "folder-meta"])
def test_a_cache_entry_file_that_is_not_a_regular_file_is_rebuilt_without_opening_it(tiny_run, tmp_path,
                                                                                      monkeypatch, plant):
    """A shared cache (MEMTRAIN_CACHE) in which someone planted a FIFO as an entry's meta.json or
    train.bin blocked the run for ever in open(); a link to /dev/zero as meta.json was read without
    end. Each is checked with lstat/stat first and the entry rebuilt."""
    import threading

    from memtrain.data.cache import prepare_tokens

    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = build_config(tiny_run)
    want = np.array(prepare_tokens(cfg.data, progress=False).train)
    entry = _entry(cfg)
    name = "train.bin" if plant.endswith("bin") else "meta.json"
    (entry / name).unlink()
    if plant.startswith("fifo"):
        os.mkfifo(entry / name)
    elif plant.startswith("zero"):
        (entry / name).symlink_to("/dev/zero")
    elif plant == "huge-meta":
        (entry / name).write_text('{"pad": "' + "x" * 2**21 + '"}')
    else:
        (entry / name).mkdir()
    got: list = []
    reader = threading.Thread(target=lambda: got.append(prepare_tokens(cfg.data, progress=False)), daemon=True)
    reader.start()
    reader.join(timeout=60)
    if reader.is_alive() and plant.startswith("fifo"):
        with open(entry / name, "wb"):  # release the blocked open, so the test process can end
            pass
    assert got, "reading the cache blocked"
    assert not got[0].from_cache and np.array_equal(np.array(got[0].train), want)


def test_token_cache_rebuilds_bad_entries_and_works_without_a_writable_cache(tiny_run, tmp_path, monkeypatch, capsys):
    from memtrain.data.cache import prepare_tokens

    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = build_config(tiny_run)
    good = prepare_tokens(cfg.data, progress=False)
    want = np.array(good.train)
    entry = _entry(cfg)
    # Out-of-range ids (same size): rebuilt, not an index error in the first step.
    bad = np.array(good.train)
    bad[5] = 65535
    bad.tofile(entry / "train.bin")
    again = prepare_tokens(cfg.data, progress=False)
    assert not again.from_cache and np.array_equal(np.array(again.train), want)
    # A wrong size: rebuilt.
    with open(entry / "val.bin", "ab") as fh:
        fh.write(b"\x00\x00")
    assert not prepare_tokens(cfg.data, progress=False).from_cache
    assert prepare_tokens(cfg.data, progress=False).from_cache
    # A stale writer's scratch folder (its pid is gone) is removed by the next writer.
    stale = entry.parent / ".tmp-999999999-abc"
    stale.mkdir()
    prepare_tokens(build_config({**tiny_run, "no_cache": True}).data, progress=False)
    assert not stale.exists()
    # A cache that cannot be written: one warning, tokens anyway.
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "afile" / "cache"))
    capsys.readouterr()
    splits = prepare_tokens(cfg.data, progress=False)
    assert np.array_equal(np.array(splits.train), want)
    warn = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    # The reason is the file in the way, not mkdir's "Not a directory" (or "File exists" for the file itself).
    assert len(warn) == 1 and "not writable (a file is in its path)" in warn[0], warn
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "afile"))
    prepare_tokens(cfg.data, progress=False)
    assert "not writable (a file is in its path)" in capsys.readouterr().err
