"""The exit-code contract on input that used to escape it (docs/reliability.md): each of these
exits 2 with exactly one ``error:`` line and no traceback, fast, where it used to exit 1 with a
library's exception, print ``NaN`` as JSON, be accepted, or wait for minutes.

- sizes beyond :mod:`memtrain.analysis.limits` on every verb (a batch of 10**30 hung ``plan``
  and overflowed ``estimate``/``flops``), memory budgets beyond 1 EiB, counts and seeds beyond
  64 bits, sampling settings that are NaN, infinite or negative;
- torchrun's launch variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/
  ``MASTER_PORT``), checked before any rendezvous (``RANK=5 WORLD_SIZE=2`` waited for ranks
  that never come);
- destinations that cannot be written (``export`` to a file or to a read-only place), an
  ``--out`` whose ``.memtrain.lock`` is a folder or a FIFO, ``--report-to wandb`` without a login;
- the device cache (the probe's measured GEMM rates): a damaged entry is measured again and
  rewritten instead of reaching ``info --json`` as ``NaN`` or breaking every train.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memtrain.checkpoints.exact as exact
import memtrain.commands.flops as flops_command
import memtrain.devices.probe as device_module
from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main
from memtrain.config.run import ConfigError
from memtrain.files.lock import FolderLock
from memtrain.files.results import LOCK_NAME

BIG = str(10**30)
HUGE = str(10**300)
RUN = {**TINY_MODEL, "seq_len": 32, "batch_size": 2, "steps": 2, "warmup_steps": 1, "val_blocks": 1,
       "warmup_timing_steps": 1, "progress": False}
# The shape flags of the verbs that size one step (estimate, flops, maxbatch, plan).
SHAPE = cli_flags({k: RUN[k] for k in ("d_model", "n_heads", "n_layers", "d_ff", "max_seq_len", "seq_len")})


def _code_and_err(argv: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in this process: its exit code (argparse's SystemExit too) and stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def _assert_one_error_line(code: int, err: str, words: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err[-2000:]
    assert words in lines[0], lines[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, small_corpus) -> Path:
    """A tiny trained checkpoint for generate and export."""
    root = tmp_path_factory.mktemp("ckpt")
    ckpt = root / "ck.pt"
    run = {**RUN, "data": str(small_corpus), "out": str(root / "run"), "save": str(ckpt)}
    assert main(["train", *cli_flags(run)]) == 0
    return ckpt


# --------------------------------------------------------------------------- sizes and numbers
@pytest.mark.parametrize("argv, words", [
    (["estimate", "--params", "0.5"], "parameter count '0.5'"),  # a ZeroDivisionError
    (["estimate", *SHAPE, "--batch-size", HUGE], "--batch-size 1.00e+300"),
    (["flops", *SHAPE, "--batch-size", HUGE], "--batch-size 1.00e+300"),
    (["plan", "--budget", "24GiB", "--batch-size", BIG], "--batch-size 1.00e+30"),  # searched for > 100 s
    (["estimate", "--d-model", BIG], "--d-model 1.00e+30"),
    (["estimate", "--d-model", "256", "--n-heads", str(10**12)], "--n-heads"),  # its hint looped over the heads
    (["flops", *SHAPE, "--vocab-multiple", BIG], "--vocab-multiple"),
    (["estimate", *SHAPE, "--grad-accum", BIG], "--grad-accum"),
    (["estimate", *SHAPE, "--world-size", BIG], "argument --world-size"),  # was answered, per rank of 10**30
    (["plan", "--budget", "1e300GB"], "memory size '1e300GB'"),
    (["plan", "--budget", "1e-300GB"], "less than one byte"),
    (["plan", "--budget", "24GiB", "--params", "0.5"], "parameter count '0.5'"),
    (["plan", "--budget", "24GiB", "--max-batch", BIG], "argument --max-batch"),
    (["maxbatch", *SHAPE, "--budget", "1e300GB"], "memory size '1e300GB'"),
    (["maxbatch", *SHAPE, "--memory-budget", "1e300GB"], "memory size '1e300GB'"),
    (["maxbatch", *SHAPE, "--memory-budget", "1GB", "--multiple-of", str(10**18)], "argument --multiple-of"),
    (["maxbatch", *SHAPE, "--memory-budget", "1GB", "--multiple-of", "64", "--max-batch", "8"], "--multiple-of 64"),
    (["bench", "--max-batch", BIG], "argument --max-batch"),
    (["bench", "--nproc", BIG], "argument --nproc"),
    (["train", "--nproc-per-node", str(10**6)], "argument --nproc-per-node"),
])
def test_absurd_sizes_are_refused_up_front(argv, words, capsys):
    start = time.monotonic()
    code, err = _code_and_err(argv, capsys)
    _assert_one_error_line(code, err, words)
    assert time.monotonic() - start < 60  # refused up front, not after a search


@pytest.mark.parametrize("extra, words", [
    (["--d-model", BIG], "--d-model 1.00e+30"),  # an overflow inside torch's empty()
    (["--batch-size", BIG], "--batch-size"),
    (["--steps", BIG], "--steps"),
    (["--prefetch-factor", "-1", "--num-workers", "1"], "--prefetch-factor"),  # DataLoader's ValueError
    (["--num-workers", BIG], "--num-workers"),
])
def test_train_refuses_absurd_numbers_before_it_starts(extra, words, small_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _code_and_err(["train", *cli_flags({**RUN, "data": str(small_corpus), "out": str(out)}), *extra],
                              capsys)
    _assert_one_error_line(code, err, words)
    assert not out.exists()


@pytest.mark.parametrize("extra, words", [
    (["--seed", BIG], "argument --seed"),  # torch: "Overflow when unpacking long long"
    (["--seed", "-1"], "argument --seed"),
    (["--temperature", "nan"], "argument --temperature"),  # was accepted
    (["--temperature", "inf"], "argument --temperature"),  # was accepted
    (["--temperature", "-0.5"], "argument --temperature"),
    # 0 in float32: the logits divided by it made NaN probabilities, torch's RuntimeError, exit 1.
    (["--temperature", "1e-300"], "argument --temperature: must be 0 (greedy) or at least 1e-30"),
    (["--top-k", "-1"], "argument --top-k"),
    (["--top-k", BIG], "argument --top-k"),
    (["--num-samples", BIG], "argument --num-samples"),  # an OverflowError in torch
    (["--max-new-tokens", "0"], "argument --max-new-tokens"),
    # Bytes the locale could not decode (lone surrogates): a transformers tokenizer's TypeError, exit 1.
    (["--prompt", "\udcff\udcfe bad"], "argument --prompt: is not UTF-8 text"),
])
def test_generate_refuses_bad_sampling_settings(extra, words, checkpoint, capsys):
    code, err = _code_and_err(["generate", str(checkpoint), "--max-new-tokens", "2", *extra], capsys)
    _assert_one_error_line(code, err, words)


def test_generate_still_takes_the_edges_of_each_range(checkpoint, capsys):
    """Greedy (temperature 0), no top-k cut (0) and the largest seed are settings, not errors."""
    argv = ["generate", str(checkpoint), "--max-new-tokens", "2", "--temperature", "0", "--top-k", "0",
            "--seed", str(2**64 - 1)]
    assert _code_and_err(argv, capsys)[0] == 0
    argv = ["generate", str(checkpoint), "--max-new-tokens", "2", "--temperature", "1e-30"]  # the smallest above greedy
    assert _code_and_err(argv, capsys)[0] == 0


# --------------------------------------------------------------------------- destinations
def test_export_refuses_a_file_or_an_unwritable_place(checkpoint, tmp_path, capsys):
    a_file = tmp_path / "model"
    a_file.write_text("in the way")
    code, err = _code_and_err(["export", str(checkpoint), str(a_file)], capsys)
    _assert_one_error_line(code, err, "is a file")  # was NotADirectoryError, exit 1
    assert a_file.read_text() == "in the way"
    if sys.platform.startswith("linux"):  # /proc takes no new files, not even from root
        code, err = _code_and_err(["export", str(checkpoint), "/proc/memtrain-export"], capsys)
        _assert_one_error_line(code, err, "is not writable")  # was FileNotFoundError, exit 1


def test_a_full_disk_while_exporting_is_the_disk_full_line(checkpoint, tmp_path, capsys, monkeypatch):
    """safetensors reports a full disk as its own SafetensorError (no OSError): the line was
    "error: SafetensorError: Error while serializing: I/O error: No space left on device"."""
    import memtrain.inference.export as export

    def full(*_args, **_kwargs):
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(export, "save_tokenizer", full)
    out = tmp_path / "exported"
    code, err = _code_and_err(["export", str(checkpoint), str(out)], capsys)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: disk full writing {out}; free space"), err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # the scratch folder is gone


@pytest.mark.parametrize("kind", ["folder", "fifo", "symlink"])
def test_a_lock_file_that_is_not_a_file_is_bad_input(kind, small_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    lock = out / LOCK_NAME
    if kind == "folder":
        lock.mkdir()  # was IsADirectoryError, exit 1
    elif kind == "fifo":
        os.mkfifo(lock)  # was "not seekable", exit 1 (reading it could block)
    else:
        (tmp_path / "elsewhere").write_text("")
        lock.symlink_to(tmp_path / "elsewhere")
    code, err = _code_and_err(["train", *cli_flags({**RUN, "data": str(small_corpus), "out": str(out)})], capsys)
    _assert_one_error_line(code, err, f"{LOCK_NAME} there is not a regular file")
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing written
    with pytest.raises(ConfigError, match="not a regular file"):  # the bench's lock is the same class
        with FolderLock(out, "memtrain bench"):
            pass


def test_report_to_wandb_without_a_login_is_one_line(small_corpus, tmp_path):
    """No API key and no network (a fresh HOME): one line that says how to log in or go offline,
    exit 2, and the folder is left as it was. A WANDB_* value wandb cannot read likewise."""
    pytest.importorskip("wandb")
    run = {**RUN, "data": str(small_corpus), "report_to": "wandb"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    home = tmp_path / "home"
    home.mkdir()
    for extra_env, words in (({}, "wandb login"), ({"WANDB_MODE": "sideways"}, "WANDB_MODE=offline")):
        out = tmp_path / f"out{len(extra_env)}"
        env = {**base, "HOME": str(home), "OMP_NUM_THREADS": "1", **extra_env}
        proc = subprocess.run([sys.executable, "-m", "memtrain", "train", *cli_flags({**run, "out": str(out)})],
                              capture_output=True, text=True, env=env, timeout=300)
        _assert_one_error_line(proc.returncode, proc.stderr, words)
        assert "--report-to wandb" in proc.stderr and not out.exists()


# --------------------------------------------------------------------------- launch variables
LAUNCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29581", "LOCAL_RANK": "0"}


@pytest.mark.parametrize("env, words", [
    ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 must be in [0, WORLD_SIZE=2)"),  # waited > 120 s
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),  # waited > 120 s
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"WORLD_SIZE": "2", "RANK": None}, "RANK is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc'"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": None}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
])
def test_bad_launch_variables_are_refused_before_any_rendezvous(env, words, small_corpus, tmp_path, capsys,
                                                                monkeypatch):
    for name, value in {**LAUNCH, **env}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("MEMTRAIN_DIST_TIMEOUT", "20")  # a regression fails in 20 s, not 300
    out = tmp_path / "out"
    start = time.monotonic()
    code, err = _code_and_err(["train", *cli_flags({**RUN, "data": str(small_corpus), "out": str(out),
                                                    "distributed": "ddp"})], capsys)
    _assert_one_error_line(code, err, words)
    assert time.monotonic() - start < 15 and not out.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "1e12", "abc", "-5", "0"])
def test_a_bad_rendezvous_timeout_is_refused_before_any_rank_starts(value, small_corpus, tmp_path, capsys,
                                                                    monkeypatch):
    """MEMTRAIN_DIST_TIMEOUT=nan or inf failed at each rank's rendezvous with Python's own words
    ("cannot convert float NaN to integer", exit 1); 1e12 seconds, past torch's int64
    nanoseconds, failed it or not from run to run ("The client socket has timed out"). Now one line naming
    the variable and its range, exit 2: under a launcher before the rendezvous, and with
    --nproc-per-node before any rank starts."""
    import memtrain.distributed.launch as launch_module

    monkeypatch.setenv("MEMTRAIN_DIST_TIMEOUT", value)
    words = f"MEMTRAIN_DIST_TIMEOUT={value!r} must be a number of seconds above 0 and at most 1e+09"
    started = []
    monkeypatch.setattr(launch_module, "launch", lambda *a, **k: started.append(a) or 0)
    run = {**RUN, "data": str(small_corpus), "distributed": "ddp", "device": "cpu"}
    code, err = _code_and_err(["train", *cli_flags({**run, "out": str(tmp_path / "a")}), "--nproc-per-node", "2"],
                              capsys)
    _assert_one_error_line(code, err, words)
    assert started == [] and not (tmp_path / "a").exists()
    for name, v in {**LAUNCH, "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, v)
    code, err = _code_and_err(["train", *cli_flags({**run, "out": str(tmp_path / "b")})], capsys)
    _assert_one_error_line(code, err, words)
    assert not (tmp_path / "b" / "result.json").exists()


# --------------------------------------------------------------------------- the device cache
def _strict(text: str) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in JSON output")

    return json.loads(text, parse_constant=refuse)


DAMAGE = {
    "nan rate": lambda e: e["rates"].update(gemm_fp32_flops=float("nan")),
    "infinite slowdown": lambda e: e["rates"].update(bf16_slowdown=float("inf")),
    "text slowdown": lambda e: e["rates"].update(bf16_slowdown="abc"),
    "list rate": lambda e: e["rates"].update(gemm_bf16_flops=[1.0]),
    "negative rate": lambda e: e["rates"].update(gemm_fp32_flops=-5.0),
    "bad shapes": lambda e: e["rates"].update(gemm_shapes={"fp32": "1024"}),
    "a caps field": lambda e: e["rates"].update(native_bf16="abc"),
    "not an object": lambda e: e.update(rates=[1, 2]),
}


@pytest.fixture
def device_cache(tmp_path, monkeypatch) -> Path:
    """A fresh, valid device cache entry of this machine; the probe's per-process memo is
    emptied, so that every command reads the file."""
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("MEMTRAIN_FORCE_NATIVE_BF16", "0")  # bf16 is slow here: train reads the slowdown
    monkeypatch.setattr(device_module, "_PROBES", {})
    device_module.probe("cpu")
    (entry,) = (tmp_path / "cache" / "device").glob("*.json")
    monkeypatch.setattr(device_module, "_PROBES", {})
    return entry


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_device_cache_entry_is_measured_again(damage, device_cache, small_corpus, tmp_path, capsys,
                                                        monkeypatch):
    entry = json.loads(device_cache.read_text())
    DAMAGE[damage](entry)
    device_cache.write_text(json.dumps(entry))  # json.dumps writes NaN/Infinity as Python reads them
    assert main(["info", "--device", "cpu", "--json"]) == 0
    caps = _strict(capsys.readouterr().out)
    assert caps["from_cache"] is False and caps["gemm_fp32_flops"] > 0 and caps["native_bf16"] is False
    healed = _strict(device_cache.read_text())  # rewritten whole
    assert healed["rates"]["gemm_fp32_flops"] == caps["gemm_fp32_flops"]
    monkeypatch.setattr(device_module, "_PROBES", {})
    device_cache.write_text(json.dumps(entry))
    run = {**RUN, "data": str(small_corpus), "out": str(tmp_path / "run"), "precision": "bf16"}
    assert main(["train", *cli_flags(run)]) == 0, capsys.readouterr().err
    assert _strict(device_cache.read_text())["rates"]["gemm_fp32_flops"] > 0


@pytest.mark.parametrize("damage", ["truncated", "not utf-8", "a folder"])
def test_an_unreadable_device_cache_entry_is_replaced(damage, device_cache, capsys, monkeypatch):
    if damage == "truncated":
        device_cache.write_text(device_cache.read_text()[:40])
    elif damage == "not utf-8":
        device_cache.write_bytes(b"\xff\xfe{")
    else:
        device_cache.unlink()
        device_cache.mkdir()
    assert main(["info", "--device", "cpu", "--json"]) == 0
    assert _strict(capsys.readouterr().out)["from_cache"] is False
    assert _strict(device_cache.read_text())["version"] == device_module.CACHE_VERSION
    assert not list(device_cache.parent.glob("*.tmp"))  # no scratch left behind
    monkeypatch.setattr(device_module, "_PROBES", {})
    assert main(["info", "--device", "cpu", "--json"]) == 0
    assert _strict(capsys.readouterr().out)["from_cache"] is True  # healed: read back next time


@pytest.mark.parametrize("verb", ["train", "maxbatch"])
def test_no_progress_bar_on_a_captured_stderr(verb, tmp_path, capsys):
    """A bar's carriage returns on a stderr that is not a terminal (a log, a script's pipe) came
    before the ``error:`` line or on it; unless --progress asks, bars draw only on a terminal."""
    if verb == "train":  # tokenized (the bar ran), then refused: fewer tokens than one batch
        small = tmp_path / "s.txt"
        small.write_text("just a few words")
        argv = ["train", "--data", str(small), "--out", str(tmp_path / "o"), *SHAPE]
    else:  # probed once (the bar ran), then refused: not even batch 1 fits
        argv = ["maxbatch", *SHAPE, "--memory-budget", "1B"]
    code, err = _code_and_err(argv, capsys)
    assert code == 2 and err.startswith("error:") and err.count("\n") == 1 and "\r" not in err, repr(err[-2000:])


def test_progress_flags_decide_and_a_terminal_decides_otherwise(monkeypatch):
    from memtrain.runtime.notices import shows_progress

    class Stream:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    for tty in (True, False):
        monkeypatch.setattr(sys, "stderr", Stream(tty))
        assert shows_progress(None) is tty and shows_progress(True) and not shows_progress(False)
    monkeypatch.setattr(sys, "stderr", None)  # pythonw: no stderr at all
    assert not shows_progress(None)


@pytest.mark.parametrize("error, size", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 6587285504 bytes. Error code 12 (Cannot allocate memory)"), "6.13 GiB"),
    ("cuda", "2.00 GiB"),
])
def test_a_batch_that_does_not_fit_is_one_line_saying_what_to_lower(tiny_run, monkeypatch, capsys, error, size):
    """A step that ran out of memory said `error: RuntimeError: [enforce fail at alloc_cpu.cpp:127] ...`
    (exit 1); it is a batch that cannot fit: one line naming the flags that lower the memory."""
    import torch

    import memtrain.training.train as train_module

    if error == "cuda":
        error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")

    def out_of_memory(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(train_module._Loop, "run", out_of_memory)
    assert main(["train", *cli_flags(tiny_run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory training batch 4 x seq 32"), err
    assert f"tried to allocate {size}" in err and "lower --batch-size" in err and "memtrain maxbatch" in err
    # The flags the run does not use yet (memtrain.analysis.advice), a shorter sequence among them.
    assert "or save memory with --loss chunked, --checkpointing full" in err and "a smaller --seq-len" in err
    assert not Path(tiny_run["out"]).exists()


def test_a_fifo_given_as_data_or_checkpoint_is_named_as_one(tmp_path: Path, capsys) -> None:
    """A FIFO where a file is expected is said to be one (it was "no file matches" for --data and
    "not found" for a checkpoint, though the path exists); nothing reads it, so nothing blocks."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, err = _code_and_err(["train", "--data", str(fifo), "--steps", "1", "--out", str(tmp_path / "o")], capsys)
    _assert_one_error_line(code, err, f"--data '{fifo}' is a FIFO, not a file")
    code, err = _code_and_err(["generate", str(fifo), "--prompt", "hi"], capsys)
    _assert_one_error_line(code, err, f"checkpoint '{fifo}' is a FIFO, not a file")
    code, err = _code_and_err(["generate", str(tmp_path / "absent.pt"), "--prompt", "hi"], capsys)
    _assert_one_error_line(code, err, "absent.pt' not found")


def test_a_fifo_or_device_given_to_resume_is_named_as_one(tmp_path: Path, capsys) -> None:
    """`train --resume` of a FIFO or a device (/dev/zero) said "not found; check --resume", though
    the path exists; it says what the path is, as --data and generate's checkpoint do, and opens
    neither (a FIFO would block)."""
    fifo = tmp_path / "pipe.pt"
    os.mkfifo(fifo)
    for ckpt, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        code, err = _code_and_err(["train", "--resume", str(ckpt), "--steps", "1", "--out", str(tmp_path / "o")],
                                  capsys)
        _assert_one_error_line(code, err, f"checkpoint '{ckpt}' is {kind}, not a file; check --resume")
    code, err = _code_and_err(["train", "--resume", str(tmp_path / "absent.pt"), "--out", str(tmp_path / "o")], capsys)
    _assert_one_error_line(code, err, "absent.pt' not found; check --resume")
    assert not (tmp_path / "o").exists()


def test_a_fifo_or_device_as_config_or_results_is_named_as_one(tmp_path: Path, capsys) -> None:
    """--config, `report DIR`'s and `plan --results DIR`'s results.jsonl that exist as a FIFO or a
    device (a link to /dev/zero) said "not found; check the --config path", though the path is
    right; each names what the path is, and nothing opens it."""
    fifo, device = tmp_path / "c.yaml", tmp_path / "z.yaml"
    os.mkfifo(fifo)
    device.symlink_to("/dev/zero")
    for cfg, kind in ((fifo, "a FIFO"), (device, "a character device")):
        code, err = _code_and_err(["estimate", "--config", str(cfg)], capsys)
        _assert_one_error_line(code, err, f"config file '{cfg}' is {kind}, not a file")
    bench = tmp_path / "b"
    bench.mkdir()
    os.mkfifo(bench / "results.jsonl")
    code, err = _code_and_err(["report", str(bench)], capsys)
    _assert_one_error_line(code, err, "results.jsonl' is a FIFO, not a file")
    code, err = _code_and_err(["plan", "--budget", "8GiB", "--results", str(bench)], capsys)
    _assert_one_error_line(code, err, "results.jsonl' is a FIFO, not a file")


@pytest.mark.parametrize("case", ["no folder", "a file as the folder", "no results.jsonl", "a FIFO", "a folder"])
def test_report_and_plan_results_say_what_is_wrong_with_a_results_folder_in_the_same_words(tmp_path, capsys, case):
    """`report DIR` and `plan --results DIR` checked DIR/results.jsonl each in its own words (quoted
    or not, "point memtrain report at ..." / "--results takes a bench output folder"), and both said
    "not found" of a results.jsonl that is a folder and of a DIR that is a file. One helper says it."""
    folder = tmp_path / "b"
    if case == "a file as the folder":
        folder.write_text("x")
    elif case != "no folder":
        folder.mkdir()
    if case == "a FIFO":
        os.mkfifo(folder / "results.jsonl")
    elif case == "a folder":
        (folder / "results.jsonl").mkdir()
    expected = {"no folder": f"'{folder}' not found", "a file as the folder": f"'{folder}' is a regular file, not a folder",
                "no results.jsonl": f"'{folder}/results.jsonl' not found",
                "a FIFO": f"'{folder}/results.jsonl' is a FIFO, not a file",
                "a folder": f"'{folder}/results.jsonl' is a directory, not a file"}[case]
    lines = []
    for argv, reader in ((["report", str(folder)], "memtrain report"),
                         (["plan", "--budget", "8GiB", "--results", str(folder)], "plan --results")):
        code, err = _code_and_err(argv, capsys)
        _assert_one_error_line(code, err, f"error: {expected}; {reader} takes a folder that memtrain bench wrote")
        lines.append(err.strip().replace(reader, "READER"))
    assert lines[0] == lines[1]


def test_a_train_out_folder_given_as_a_model_folder_names_its_checkpoint(tmp_path: Path, capsys) -> None:
    """`generate runs/x` (a train --out folder) said only that a model folder needs its config.json;
    the line names the run's checkpoint to give instead, and `memtrain export`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text("{}")
    (run / "ckpt.pt").write_bytes(b"")
    code, err = _code_and_err(["generate", str(run), "--prompt", "hi"], capsys)
    _assert_one_error_line(code, err, f"is a train --out folder: give its checkpoint ('{run / 'ckpt.pt'}')")
    assert "memtrain export CKPT DIR" in err


@pytest.mark.parametrize("code_name", ["EACCES", "EROFS"])
def test_a_write_the_user_may_not_make_is_bad_input(tmp_path: Path, capsys, monkeypatch, code_name: str) -> None:
    """A folder the user may not write (permission denied, a read-only file system) is one line with
    exit 2 naming the path, not a PermissionError with exit 1 (tests run as root, where no folder
    refuses: the write is made to fail as the file system would)."""
    target = tmp_path / "roofline.png"

    def refused(report, path) -> None:
        raise OSError(getattr(errno, code_name), "refused", str(path))

    monkeypatch.setattr(flops_command, "plot_roofline", refused)
    code, err = _code_and_err(["flops", "--plot", str(target)], capsys)
    _assert_one_error_line(code, err, f"on '{target}'; change its permissions or give memtrain another path")


def test_unreadable_inputs_are_named_with_the_reason(tmp_path: Path, capsys, monkeypatch, small_corpus) -> None:
    """A --data file, a checkpoint or a model folder's config.json that cannot be opened says so and
    why, instead of a PermissionError (exit 1) or "it is not a memtrain checkpoint"."""
    real_open, real_read_text = pathlib.Path.open, pathlib.Path.read_text

    def refusing_open(self, *args, **kwargs):
        if self.name in ("corpus.txt", "config.json"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    def refusing_read_text(self, *args, **kwargs):
        if self.name == "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)

    real_os_open = os.open

    def refusing_os_open(path, *args, **kwargs):
        # The bounded JSON reader (files.json_file) opens a descriptor, not a Path.
        if os.path.basename(os.fspath(path)) == "config.json":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    data = tmp_path / "corpus.txt"
    data.write_text(small_corpus.read_text())
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    checkpoint = tmp_path / "ckpt.pt"
    checkpoint.write_bytes(b"PK")
    monkeypatch.setattr(pathlib.Path, "open", refusing_open)
    monkeypatch.setattr(pathlib.Path, "read_text", refusing_read_text)
    monkeypatch.setattr(os, "open", refusing_os_open)
    monkeypatch.setattr(exact, "load_plain", lambda p, **kw: (_ for _ in ()).throw(PermissionError(13, "Permission denied", str(p))))
    out = tmp_path / "out"
    code, err = _code_and_err(["train", "--data", str(data), "--steps", "1", "--out", str(out)], capsys)
    _assert_one_error_line(code, err, f"cannot read --data file '{data}' (Permission denied); check its permissions")
    assert not (out / "metrics.jsonl").exists()
    code, err = _code_and_err(["generate", str(checkpoint), "--prompt", "hi"], capsys)
    _assert_one_error_line(code, err, f"cannot read checkpoint '{checkpoint}' (Permission denied); check its permissions")
    code, err = _code_and_err(["estimate", "--model", str(model)], capsys)
    _assert_one_error_line(code, err, "config.json' (Permission denied); check its permissions")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("stderr", ["closed", "full disk"])
def test_the_exit_code_does_not_depend_on_where_stderr_goes(stderr, small_corpus, tmp_path):
    """Bad input with stderr closed (`2>&-`: Python's sys.stderr is None) or on a full disk
    (`2> log`, ENOSPC): writing the error line raised, and the exit was 1, not 2. A train whose
    warnings and progress meet a full disk on stderr stopped too. stderr holds diagnostics
    only: the bad input is exit 2, the train finishes with exit 0 and its result."""
    def run(*argv: str) -> int:
        with open("/dev/full", "w") as full:
            proc = subprocess.run([sys.executable, "-m", "memtrain", *argv], stdout=subprocess.DEVNULL, timeout=300,
                                  stderr=full if stderr == "full disk" else None, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                  preexec_fn=(lambda: os.close(2)) if stderr == "closed" else None)
        return proc.returncode

    assert run("train", "--steps", "-1", "--out", str(tmp_path / "bad")) == 2
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "run"
    settings = {**TINY_MODEL, "data": str(small_corpus), "steps": 3, "warmup_steps": 1, "batch_size": 2,
                "seq_len": 32, "val_blocks": 1, "out": str(out)}
    assert run("train", *cli_flags(settings), "--progress") == 0
    assert json.loads((out / "result.json").read_text())["steps"] == 3


# The console entry with a stand-in for a C library (OpenMP, a tokenizer) or a child process
# that writes to descriptors 1 and 2 themselves, not through sys.stderr: each time a file is
# renamed into place (result.json, the checkpoint), and once more at the end.
CLOSED_STREAMS_PROBE = """
import os, sys
real_replace = os.replace

def replace_saying_so(src, dst, **kw):
    os.write(2, b"warning: written to descriptor 2\\n")
    os.write(1, b"progress written to descriptor 1\\n")
    return real_replace(src, dst, **kw)

os.replace = replace_saying_so
from memtrain.__main__ import run
code = run(sys.argv[2:])
where = [os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else "closed" for fd in (0, 1, 2)]
with open(sys.argv[1], "w") as f:
    f.write("\\n".join(where))
sys.exit(code)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="reads /proc/self/fd")
@pytest.mark.parametrize("closed", [(2,), (1, 2), (0, 1, 2)])
def test_descriptors_closed_at_start_are_dev_null_and_no_file_takes_their_writes(closed, small_corpus, tmp_path):
    """A train started with standard descriptors closed (`2>&-`, `>&- 2>&-`, `<&- >&- 2>&-`):
    the next file opened took the lowest free descriptor, and a write meant for stderr or stdout
    landed in it. The entry points each closed one at /dev/null first; the run's files are
    intact JSON."""
    out, where = tmp_path / "run", tmp_path / "where.txt"
    settings = {**TINY_MODEL, "data": str(small_corpus), "steps": 2, "warmup_steps": 1, "batch_size": 2,
                "seq_len": 32, "val_blocks": 1, "out": str(out), "save": str(tmp_path / "c.pt")}
    proc = subprocess.run([sys.executable, "-c", CLOSED_STREAMS_PROBE, str(where), "train", *cli_flags(settings), "--progress"],
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=lambda: [os.close(fd) for fd in closed])  # type: ignore[func-returns-value]
    assert proc.returncode == 0
    assert [line for fd, line in enumerate(where.read_text().splitlines()) if fd in closed] == [os.devnull] * len(closed)
    assert json.loads((out / "result.json").read_text())["steps"] == 2
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()][:2] == [1, 2]
    assert "written to descriptor" not in (out / ".memtrain.lock").read_text(errors="replace")
    assert b"written to descriptor" not in (tmp_path / "c.pt").read_bytes()


def test_an_exceptions_first_line_is_its_message_or_its_type():
    """One helper says what a library's exception says, in the one line an ``error:`` has room
    for: its first non-blank line, or its type's name when the message is empty."""
    from memtrain.errors import first_line

    assert first_line(ValueError("\n  bad field\nTraceback details\n")) == "bad field"
    assert first_line(KeyError()) == "KeyError"
    assert first_line(RuntimeError("   ")) == "RuntimeError"


def test_a_failures_type_and_first_line_name_it_in_one_line():
    """The ``error:`` line of a failure that is not bad input and a bench row's ``error`` name it
    the same way: its type, then its message's first non-blank line (nothing when it has none)."""
    from memtrain.distributed.rank_errors import error_line
    from memtrain.errors import typed_first_line

    assert typed_first_line(ValueError("\n  bad field\nTraceback details\n")) == "ValueError: bad field"
    assert typed_first_line(RuntimeError()) == "RuntimeError: "
    assert error_line(OSError("disk gone\nmore")) == "error: OSError: disk gone (set MEMTRAIN_DEBUG=1 for the traceback)"


def test_a_value_starting_with_a_dash_is_said_to_read_as_a_flag(capsys):
    """`--budget -1GiB`: argparse reads -1GiB as a flag and says only "expected one argument";
    the line says how to pass it, and that spelling reaches the value's own check."""
    code, err = _code_and_err(["plan", "--budget", "-1GiB"], capsys)
    _assert_one_error_line(code, err, "write --budget=-1GiB")
    code, err = _code_and_err(["plan", "--budget=-1GiB"], capsys)
    _assert_one_error_line(code, err, "is not positive")
    # A flag given where the value belongs is no value with a dash: no hint.
    code, err = _code_and_err(["train", "--out", "o", "--steps", "--lr", "1"], capsys)
    _assert_one_error_line(code, err, "expected one argument")
    assert "reads as a flag" not in err, err
