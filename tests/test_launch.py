"""Multi-rank failures and the --out lock (docs/reliability.md): ``memtrain train
--nproc-per-node N`` checks its input before starting a rank and reports a failure as one
``error:`` line with the ranks' exit code; a refusal that only one rank sees fails every rank
(rank 0 says it); a train holds its --out folder like a bench."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main
from memtrain.config.run import ConfigError, build_config
from memtrain.distributed.launch import report_failures
from memtrain.distributed.rank_errors import agreement, error_line_of, record_error_line
from memtrain.files.lock import FolderLock, file_lock

RUN = {"seq_len": 32, "steps": 4, "warmup_steps": 1, "val_blocks": 2, "warmup_timing_steps": 1, "batch_size": 2,
       "progress": False}


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    return lines[0]


def _sharded_checkpoint(root: Path, settings: dict, rank1: bytes | None) -> Path:
    """A 2-rank checkpoint of the run ``settings`` with a real DCP .metadata and rank-0.pt;
    ``rank-1.pt`` holds ``rank1`` (None: missing)."""
    import torch.distributed.checkpoint as dcp

    ckpt = root / "ck"
    root.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", store=dist.FileStore(str(root / "store"), 1), rank=0, world_size=1)
    try:
        dcp.save({"model": {"x": torch.zeros(2)}}, checkpoint_id=str(ckpt))
    finally:
        dist.destroy_process_group()
    (ckpt / "meta.json").write_text(json.dumps({
        "format": "memtrain-dcp-1", "step": 1, "losses": [1.0], "loader": {"epoch": 0, "batch_index": 1},
        "world_size": 2, "strategy": "ddp", "config": build_config(settings).to_dict()}))
    torch.save({"scheduler": {"last_epoch": 1}, "rng_cpu": torch.get_rng_state(), "rng_cuda": [], "scaler": None,
                "skipped_steps": 0, "optimizer": None, "param_groups": None}, ckpt / "rank-0.pt")
    if rank1 is not None:
        (ckpt / "rank-1.pt").write_bytes(rank1)
    return ckpt


# --------------------------------------------------------------------------- the launcher
def test_resume_alone_of_a_ranks_run_takes_its_strategy_when_launched_as_ranks(small_corpus, tmp_path, capsys,
                                                                               monkeypatch):
    """`train --resume CKPT` of a 2-rank checkpoint: alone, one line says how many ranks resume it;
    with --nproc-per-node 2 the saved --distributed is taken (no flag repeated) and ranks start."""
    started = []
    monkeypatch.setattr("memtrain.distributed.launch.launch", lambda *a: started.append(a) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = {**TINY_MODEL, **RUN, "data": str(small_corpus), "out": str(tmp_path / "out"), "distributed": "ddp"}
    ckpt = _sharded_checkpoint(tmp_path / "out", run, rank1=b"rank 1")  # in its --out, which it lends
    assert main(["train", "--resume", str(ckpt)]) == 2
    assert "was written by 2 ranks; resume with --nproc-per-node 2" in _one_error_line(capsys.readouterr().err)
    assert main(["train", "--resume", str(ckpt), "--nproc-per-node", "2"]) == 0, capsys.readouterr().err
    assert len(started) == 1


def test_launcher_checks_input_before_starting_any_rank(small_corpus, tmp_path, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("memtrain.distributed.launch.launch", lambda *a: started.append(a) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = {**TINY_MODEL, **RUN, "data": str(small_corpus), "out": str(tmp_path / "out"), "distributed": "ddp"}
    flags = cli_flags(run)
    ck_missing = _sharded_checkpoint(tmp_path / "a", run, rank1=None)
    for extra, words in [(["--seed", "-1"], "--seed"),
                         (["--distributed", "none"], "add --distributed ddp"),
                         (["--resume", str(ck_missing)], "lacks rank-1.pt"),
                         (["--nproc-per-node", "3", "--resume", str(ck_missing)], "resume with --nproc-per-node 2")]:
        argv = ["train", *flags, "--nproc-per-node", "2", *extra]
        assert main(argv) == 2, extra
        assert words in _one_error_line(capsys.readouterr().err)
    with pytest.raises(SystemExit) as exit_:  # argparse: a positive count
        main(["train", *flags, "--nproc-per-node", "0"])
    assert exit_.value.code == 2
    assert "--nproc-per-node" in _one_error_line(capsys.readouterr().err)
    monkeypatch.setenv("WORLD_SIZE", "2")  # already under torchrun: a second launcher is refused
    assert main(["train", *flags, "--nproc-per-node", "2"]) == 2
    assert "under torchrun drop it" in _one_error_line(capsys.readouterr().err)
    assert not started and not (tmp_path / "out").exists()  # nothing started, nothing written


def test_a_meta_json_that_lies_about_its_rank_count_is_refused_naming_the_rank_file(small_corpus, tmp_path, capsys,
                                                                                    monkeypatch):
    """A 2-rank checkpoint whose meta.json says 1 rank was resumed by `--nproc-per-node 1`, on
    another global batch and without rank 1's state, silently. The rank files it holds give the
    count away: the resume is refused naming the file, whatever --nproc-per-node says."""
    started = []
    monkeypatch.setattr("memtrain.distributed.launch.launch", lambda *a: started.append(a) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = {**TINY_MODEL, **RUN, "data": str(small_corpus), "out": str(tmp_path / "out"), "distributed": "ddp"}
    ckpt = _sharded_checkpoint(tmp_path / "a", run, rank1=None)
    torch.save(torch.load(ckpt / "rank-0.pt", weights_only=True), ckpt / "rank-1.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "world_size": 1}))
    for n in ("1", "2"):
        assert main(["train", *cli_flags(run), "--resume", str(ckpt), "--nproc-per-node", n]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "is damaged: it says 1 ranks wrote it, but it holds rank-1.pt" in line, line
    assert not started and not (tmp_path / "out").exists()


def test_more_cpu_ranks_than_the_host_memory_holds_are_refused_before_any_starts(small_corpus, tmp_path, capsys,
                                                                                monkeypatch):
    """`--nproc-per-node 1000` on the CPU started 1000 interpreters on a 23 GiB host until the kernel
    killed them (minutes, then no line). Each rank takes at least the launcher's own memory: the
    count is checked against what the host has available, and the line names a count that fits."""
    from memtrain.training import size_check

    started = []
    monkeypatch.setattr("memtrain.distributed.launch.launch", lambda *a: started.append(a) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(size_check, "host_available_bytes", lambda: 10 * 2**30)  # 10 GiB available
    statm = tmp_path / "statm"
    statm.write_text(f"100000 {2**28 // os.sysconf('SC_PAGE_SIZE')} 0 0 0 0 0\n")  # 256 MiB resident
    monkeypatch.setattr(size_check, "STATM", statm)
    run = {**TINY_MODEL, **RUN, "data": str(small_corpus), "out": str(tmp_path / "out"), "distributed": "ddp"}
    assert main(["train", *cli_flags(run), "--nproc-per-node", "1000"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "1000 CPU ranks of at least 256 MiB each" in line and "use --nproc-per-node 40 or fewer" in line
    assert not started and not (tmp_path / "out").exists()
    assert main(["train", *cli_flags(run), "--nproc-per-node", "40"]) == 0  # 40 x 256 MiB = 10 GiB fits
    assert len(started) == 1


def test_launched_ranks_refuse_together_and_the_line_is_said_once(small_corpus, tmp_path):
    """rank-1.pt is corrupt: only rank 1 can see it. Every rank exits 2, rank 0 says rank
    1's reason (the ``rank 1:`` prefix is only in rank 0's line), and the launcher prints it
    once, as the last line, without torch's failure summary."""
    run = {**TINY_MODEL, **RUN, "data": str(small_corpus), "distributed": "ddp"}
    ckpt = _sharded_checkpoint(tmp_path, run, rank1=b"not a checkpoint")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "memtrain", "train", *cli_flags({**run, "resume": str(ckpt), "out": str(out)}),
           "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(tmp_path / "cache"), "MEMTRAIN_DIST_TIMEOUT": "60"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr)
    assert line.startswith("error: rank 1: cannot read") and "rank-1.pt" in line
    assert "ChildFailedError" not in proc.stderr and not out.exists()


def test_report_failures_prefers_the_refusal_and_its_own_line(capsys):
    def failure(code: int, message: object = "", stamp: int = 0):
        return SimpleNamespace(exitcode=code, message=message, timestamp=stamp,
                               signal_name=lambda: signal.Signals(-code).name)

    line = "error: rank 1: --data 'x' not found"
    # rank 0 was stopped by the launcher's SIGTERM, rank 1 refused its input
    assert report_failures({0: failure(-15), 1: failure(2, {"message": line})}) == 2
    assert capsys.readouterr().err == line + "\n"
    assert report_failures({0: failure(1, {"message": "error: RuntimeError: boom"}, 5), 1: failure(-15)}) == 1
    assert capsys.readouterr().err == "error: RuntimeError: boom\n"
    assert report_failures({0: failure(-9)}) == 1  # no line anywhere: say who and how
    assert _one_error_line(capsys.readouterr().err).startswith("error: rank 0 ended with signal SIGKILL")
    # torch's agent saw only rank 1 fail; rank 0's own line (from the launcher's folder) wins
    said = {0: ("error: rank 1: bad shard", 2), 1: ("error: bad shard", 2)}
    assert report_failures({1: failure(2, {"message": "error: bad shard"})}, said) == 2
    assert capsys.readouterr().err == "error: rank 1: bad shard\n"


def test_report_failures_ranks_the_lines_it_has(capsys):
    """A refusal (2) outranks an interruption (130) whatever the ranks' order, the lowest
    refusing rank's line is the one said, and among plain failures the rank that failed first."""
    def failure(code: int, message: object = "", stamp: int = 0):
        return SimpleNamespace(exitcode=code, message=message, timestamp=stamp, signal_name=lambda: "SIGTERM")

    said = {0: ("error: interrupted", 130), 2: ("error: rank 2: bad --data", 2), 1: ("error: rank 1: bad --data", 2)}
    assert report_failures({}, said) == 2
    assert capsys.readouterr().err == "error: rank 1: bad --data\n"
    assert report_failures({}, {1: ("error: interrupted", 130)}) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    later = failure(1, {"message": "error: RuntimeError: follow-on"}, stamp=9)
    first = failure(1, {"message": "error: RuntimeError: the cause"}, stamp=3)
    assert report_failures({0: later, 1: first}) == 1
    assert capsys.readouterr().err == "error: RuntimeError: the cause\n"


def test_an_interrupted_launch_is_one_line_and_exit_130(monkeypatch, capsys):
    from memtrain.distributed import launch as module
    from memtrain.distributed.rank_errors import ERROR_DIR_ENV, LAUNCHED_ENV
    from memtrain.runtime.signals import LAUNCHER_PID_ENV

    for name in (LAUNCHED_ENV, LAUNCHER_PID_ENV, ERROR_DIR_ENV):  # launch sets them: restored after
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("MEMTRAIN_VERBOSE", "1")  # keeps this process's logging on

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    assert module.launch(2, ["train"]) == 130
    assert _one_error_line(capsys.readouterr().err).startswith("error: interrupted; the ranks were stopped")


def test_report_failures_names_the_rank_that_ended_first_not_the_one_torch_stopped(capsys):
    """Seen from a 2-rank run: rank 1 SIGKILLed, torch's agent then SIGTERMs rank 0. The line named
    rank 0 and SIGTERM (exit 1). A SIGTERM to one rank (both end by SIGTERM) said the same,
    though the run was interrupted: now exit 130, as SIGTERM to the launcher."""
    def failure(code: int):
        return SimpleNamespace(exitcode=code, message="", timestamp=0,
                               signal_name=lambda: signal.Signals(-code).name if code < 0 else "")

    assert report_failures({0: failure(-15), 1: failure(-9)}) == 1
    assert _one_error_line(capsys.readouterr().err).startswith("error: rank 1 ended with signal SIGKILL")
    assert report_failures({0: failure(-15), 1: failure(1)}) == 1
    assert _one_error_line(capsys.readouterr().err).startswith("error: rank 1 ended with exit code 1")
    assert report_failures({0: failure(-15), 1: failure(-15)}) == 130
    assert _one_error_line(capsys.readouterr().err).startswith("error: interrupted: a rank was sent SIGTERM")


def test_error_line_goes_into_torchelastics_error_file(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_error_line("error: --seed must be in [0, 2**32), got -1")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(path))  # torch's own reader
    assert error_line_of(failure.message) == "error: --seed must be in [0, 2**32), got -1"


def test_agreement_without_a_process_group_re_raises_as_is():
    with pytest.raises(ConfigError, match="bad"):
        with agreement():
            raise ConfigError("bad")
    with agreement():
        pass  # nothing failed: nothing raised


# --------------------------------------------------------------------------- the --out lock
def _refusals_while_training(monkeypatch, second_holder) -> list[str]:
    """The refusals a second holder (``second_holder()``, a lock) meets while the next train runs
    (tried as it tokenizes, after its locks are taken)."""
    import memtrain.training.train as train_module

    refused: list[str] = []
    real = train_module.prepare_splits

    def during_the_run(*a, **kw):
        try:
            with second_holder():
                pass
        except ConfigError as exc:
            refused.append(str(exc))
        return real(*a, **kw)

    monkeypatch.setattr(train_module, "prepare_splits", during_the_run)
    return refused


def test_train_holds_its_out_folder_like_a_bench(tiny_run, capsys, monkeypatch):
    tiny_run = {**tiny_run, "steps": 2, "warmup_steps": 1, "warmup_timing_steps": 1, "val_blocks": 1}
    out = Path(tiny_run["out"])
    with FolderLock(out, "memtrain bench"):  # a bench (or another train) is using the folder
        assert main(["train", *cli_flags(tiny_run)]) == 2
        assert "is in use by memtrain bench (pid" in _one_error_line(capsys.readouterr().err)
    assert not (out / "result.json").exists()

    refused = _refusals_while_training(monkeypatch, lambda: FolderLock(out, "memtrain bench"))
    assert main(["train", *cli_flags(tiny_run)]) == 0
    assert refused and "in use by memtrain train (pid" in refused[0]
    with FolderLock(out, "memtrain bench"):  # released when the train ended
        pass


def test_a_second_train_on_the_folder_of_a_running_one_is_told_it_is_in_use(tiny_run, capsys):
    """The running train has written metrics.jsonl: a second train on its folder was told the folder
    "already holds metrics.jsonl of an earlier run" and to continue it with --resume. It is told the
    folder is in use, by whom, and to wait; the running run's files are untouched."""
    run = {**tiny_run, "steps": 2, "warmup_steps": 1, "warmup_timing_steps": 1, "val_blocks": 1}
    out = Path(run["out"])
    with FolderLock(out, "memtrain train"):  # the first run, still running
        (out / "metrics.jsonl").write_text('{"step": 1}\n')
        assert main(["train", *cli_flags(run)]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"--out {str(out)!r} is in use by memtrain train (pid {os.getpid()})" in line, line
        assert "wait for it to finish" in line and "earlier run" not in line
        assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert main(["train", *cli_flags(run)]) == 2  # the run ended: its files are said as an earlier run's
    assert "already holds metrics.jsonl of an earlier run" in _one_error_line(capsys.readouterr().err)


def test_a_train_whose_checks_passed_before_another_finished_on_its_out_never_replaces_its_results(
        tiny_run, capsys, monkeypatch):
    """Two trains on one --out, the second checked before the first took the folder and
    taking it after the first ended: the lock no longer refuses it, but the first run's
    metrics.jsonl is opened exclusively, so the second is refused (exit 2) and the first's
    result.json and curve are as it wrote them."""
    from memtrain.training import train as train_module

    run = {**tiny_run, "steps": 2, "warmup_steps": 1, "warmup_timing_steps": 1, "val_blocks": 1}
    out = Path(run["out"])
    real, first = train_module.check_optimizer_installed, []

    def the_first_runs_meanwhile(technique):  # after the second's destination checks, before its lock
        if not first:  # another process, as a second command would be
            first.append(subprocess.run([sys.executable, "-m", "memtrain", "train", *cli_flags({**run, "seed": 1})],
                                        capture_output=True, timeout=240).returncode)
        return real(technique)

    monkeypatch.setattr(train_module, "check_optimizer_installed", the_first_runs_meanwhile)
    assert main(["train", *cli_flags({**run, "seed": 2})]) == 2 and first == [0]
    assert "metrics.jsonl' already exists and is not overwritten" in capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["config"]["train"]["seed"] == 1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3  # the first run's lines only


def test_two_trains_with_one_save_file_are_not_both_run(tiny_run, tmp_path, capsys, monkeypatch):
    """Two runs with different --out but one --save would each replace the other's checkpoint
    and both succeed: the second is refused while the first holds the file; the lock beside the
    checkpoint goes with the run."""
    save = tmp_path / "shared" / "ck.pt"
    tiny_run = {**tiny_run, "steps": 2, "warmup_steps": 1, "warmup_timing_steps": 1, "val_blocks": 1,
                "save": str(save)}
    with file_lock(save, "memtrain train", "--save"):  # another run is training into that file
        assert main(["train", *cli_flags(tiny_run)]) == 2
        assert f"--save '{save}' is in use by memtrain train (pid" in _one_error_line(capsys.readouterr().err)
    assert not save.exists() and not (Path(tiny_run["out"]) / "result.json").exists()

    refused = _refusals_while_training(monkeypatch, lambda: file_lock(save, "memtrain train", "--save"))
    assert main(["train", *cli_flags(tiny_run)]) == 0
    assert refused and "is in use by memtrain train (pid" in refused[0]
    assert save.is_file() and sorted(p.name for p in save.parent.iterdir()) == ["ck.pt"]  # no lock left


def test_a_refused_train_leaves_no_out_folder(small_corpus, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out"
    run = {**TINY_MODEL, **RUN, "data": str(empty), "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 2  # refused after the lock was taken (at tokenizing)
    _one_error_line(capsys.readouterr().err)
    assert not out.exists()
    # Nor a --save folder that the save file's lock made (nor that lock, in a folder already there).
    assert main(["train", *cli_flags({**run, "save": str(tmp_path / "ckpts" / "ck.pt")})]) == 2
    assert main(["train", *cli_flags({**run, "save": str(tmp_path / "ck.pt")})]) == 2
    _one_error_line(capsys.readouterr().err.splitlines(keepends=True)[-1])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


# --------------------------------------------------------------------------- log noise and siblings
def _last_line_is_the_only_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error:"), err
    return _one_error_line(err)


def test_datasets_and_hub_logs_stay_off_the_error_line(tmp_path, capfd):
    """datasets logs a JSON parse error at ERROR and huggingface_hub every Hub retry at
    WARNING; memtrain says the same in its one line."""
    import logging

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "ok"}\n{not json\n')
    run = {**TINY_MODEL, **RUN, "data": str(bad), "text_field": "body", "out": str(tmp_path / "out")}
    assert main(["train", *cli_flags(run)]) == 2
    assert "cannot read" in _last_line_is_the_only_error(capfd.readouterr().err)
    # the Hub's retry warning (a real retry takes ~20 s of back-off: its logger is checked instead)
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 8s [Retry 4/5].")
    assert "Retrying" not in capfd.readouterr().err


def test_ctrl_c_before_the_command_runs_is_one_line(monkeypatch, capsys):
    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr("memtrain.cli.build_parser", interrupted)  # e.g. while torch imports
    assert main(["estimate"]) == 130
    assert "interrupted" in _one_error_line(capsys.readouterr().err)


# The console script pip writes for the entry point in pyproject.toml, with the signal sent while
# memtrain.cli imports its configuration modules (the import takes most of the startup).
_CONSOLE_SCRIPT = """
import builtins, os, signal, sys
real_import = builtins.__import__
def import_(name, *args, **kwargs):
    if name == "memtrain.config.aliases":
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    return real_import(name, *args, **kwargs)
builtins.__import__ = import_
from {module} import {function}
sys.exit({function}(["info"]))
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_the_command_imports_is_one_line(sig):
    """Ctrl-C while the console script imported memtrain.cli printed a traceback (exit 1); a SIGTERM
    ended the process without a line (exit 143), a SIGHUP (a terminal hung up) without one too (exit
    129). The entry point now handles them before the import."""
    import tomllib

    entry = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]["memtrain"]
    module, function = entry.split(":")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MEMTRAIN_DEBUG")}
    env["PYTHONPATH"] = str(Path(__file__).parents[1] / "src")
    proc = subprocess.run([sys.executable, "-c", _CONSOLE_SCRIPT.format(module=module, function=function), sig],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 130, (proc.returncode, proc.stderr)
    assert "interrupted" in _one_error_line(proc.stderr)


@pytest.mark.parametrize("field, value, words", [("hidden_act", "nonexistent", "hidden_act 'nonexistent' is no activation"),
                                                 ("head_dim", 0, "head_dim 0 is not a positive whole number"),
                                                 ("rope_scaling", {"type": "evil", "factor": 2.0},
                                                  "rope_scaling type 'evil' is no rotary embedding")])
def test_config_values_transformers_cannot_build_are_bad_input(tmp_path, capsys, field, value, words):
    """transformers reads an unknown activation, a head_dim of 0 or an unknown rope_scaling type without
    a word (or with a warning), then fails building the model (KeyError, ZeroDivisionError: exit 1) in
    train, a trace or generate."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
        "intermediate_size": 64, "vocab_size": 100, "max_position_embeddings": 64, field: value}))
    assert main(["estimate", "--trace", "--seq-len", "16", "--batch-size", "1", "--model", str(tmp_path)]) == 2
    assert words in _one_error_line(capsys.readouterr().err)


def test_bad_transformers_model_folders_are_bad_input(tmp_path, capsys):
    """--model DIR: an invalid size in config.json, or a corrupt *.safetensors file, is exit 2
    (was exit 1 with transformers' or safetensors' exception); remote code stays refused."""
    pytest.importorskip("transformers")
    text_size = tmp_path / "text_size"
    text_size.mkdir()
    (text_size / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": "big", "n_layer": 2, "n_head": 4}))
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "evil", "auto_map": {"AutoConfig": "evil.Config"}}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2,
                                                    "vocab_size": 128, "n_positions": 64,
                                                    "bos_token_id": 0, "eos_token_id": 0}))
    (broken / "model.safetensors").write_bytes(b"\xff" * 64)
    # transformers states the reason on the line after its headline: kept in the one line.
    heads = tmp_path / "heads"
    heads.mkdir()
    (heads / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 3,
                                                   "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}))
    for argv, words in [(["estimate", "--model", str(text_size)], "cannot read the model config"),
                        (["estimate", "--model", str(heads)], "hidden size (64) is not a multiple of the number of "
                                                               "attention heads (3)"),
                        (["estimate", "--model", str(remote)], "cannot read the model config"),
                        (["train", *cli_flags({**RUN, "steps": 1, "out": str(tmp_path / "o")}), "--model", str(broken)],
                         "cannot read the weights")]:
        assert main(argv) == 2, argv
        assert words in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_odd_data_paths_are_refused_without_hanging(tmp_path, capsys):
    """A symlink loop, a FIFO (opening it would block forever) and a folder of empty files."""
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    fifo_dir = tmp_path / "fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "a.txt")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").touch()
    (empty / "b.jsonl").touch()
    for data in ("loop1", "fifo", "fifo/a.txt", "empty"):
        run = {**TINY_MODEL, **RUN, "steps": 1, "data": str(tmp_path / data), "out": str(tmp_path / "o")}
        assert main(["train", *cli_flags(run)]) == 2, data
        _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


def test_a_url_as_data_is_said_to_be_one(tmp_path, capsys):
    """A URL given as --data was looked for as a local path: "no file matches
    'https://example.com/posts.jsonl'", as if mistyped. The line says memtrain reads no URL and
    what to give instead."""
    for data in ("https://example.com/posts.jsonl", "s3://bucket/posts?part=1", "hf:json:https://example.com/*.jsonl"):
        run = {**TINY_MODEL, **RUN, "steps": 1, "data": data, "out": str(tmp_path / "o")}
        assert main(["train", *cli_flags(run)]) == 2, data
        line = _one_error_line(capsys.readouterr().err)
        assert "is a URL" in line and "download it and give its path" in line, line
    assert not (tmp_path / "o").exists()


def test_a_launched_flag_left_without_its_launcher_still_says_the_line(monkeypatch, tmp_path, capsys):
    """MEMTRAIN_LAUNCHED=1 in an environment memtrain's launcher did not make (no error folder
    for it to read): a refused run exited 2 with no line at all, each rank leaving its line to a
    launcher that was not there. The line is said."""
    monkeypatch.setenv("MEMTRAIN_LAUNCHED", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MEMTRAIN_ERROR_DIR", raising=False)
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: RANK is not set but WORLD_SIZE is") and err.count("\n") == 1
