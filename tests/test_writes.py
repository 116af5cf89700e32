"""What memtrain writes: never through a link, never over what it must not replace, and nothing a
run produced is lost to a second run, a full disk on one path, or a kill mid-save
(docs/reliability.md, "Nothing produced is lost")."""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import cli_flags
from memtrain.cli import main

DATA = Path(__file__).parent / "data"
ATTACK = "x\n`touch /tmp/pwned` #| <img src=x onerror=alert(1)> [link](http://e.x) \x1b[2J"


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    return lines[0]


def _bench_folder(root: Path, technique: str = "baseline", description: str | None = None) -> Path:
    """A bench folder whose results.jsonl holds the synthetic rows, the first renamed."""
    rows = [json.loads(line) for line in (DATA / "bench_results.jsonl").read_text().splitlines()]
    rows[0]["technique"] = technique
    if description is not None:
        rows[0]["description"] = description
    out = root / "bench"
    out.mkdir()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


# --------------------------------------------------------------------------- 1. report: links and escaping
@pytest.mark.parametrize("name", ["report.md", "report.csv", "report.json", "peak_memory.png"])
def test_report_refuses_a_link_at_any_of_its_files_and_writes_through_none(tmp_path, capsys, name):
    out = _bench_folder(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / name).symlink_to(victim)
    assert main(["report", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert name in line and "symbolic link" in line
    assert victim.read_text() == "precious\n" and (out / name).is_symlink()
    # Checked before the first write: no other file of the report was written either.
    assert not [p.name for p in out.iterdir() if p.name.startswith("report.") and p.name != name]


def test_bench_refuses_links_in_its_folder_before_any_row_runs(small_corpus, tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    for name in ("results.jsonl", ".memtrain.lock"):
        (out / name).symlink_to(victim)
        assert main(["bench", "--techniques", "baseline", "--out", str(out), "--no-maxbatch",
                     "--data", str(small_corpus), "--steps", "2", "--no-progress"]) == 2
        assert name in _one_error_line(capsys.readouterr().err)
        assert victim.read_text() == "precious\n"
        (out / name).unlink()
    assert sorted(p.name for p in out.iterdir()) == []  # nothing ran, nothing was written


@pytest.mark.parametrize("link", ["rows", "rows/baseline"])
def test_bench_refuses_a_link_where_a_row_runs_before_any_row_runs(small_corpus, tmp_path, capsys, link):
    """Each row runs in OUT/rows/NAME: a link there made the row create its folder, and run, at
    the link's target, outside the bench folder."""
    out = tmp_path / "b"
    (out / link).parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / link).symlink_to(elsewhere)
    assert main(["bench", "--techniques", "baseline", "--out", str(out), "--no-maxbatch",
                 "--data", str(small_corpus), "--steps", "2", "--no-progress"]) == 2
    assert f"{link!r} is a symbolic link" in _one_error_line(capsys.readouterr().err)
    assert list(elsewhere.iterdir()) == []
    assert not (out / ".memtrain.lock").exists()


@pytest.fixture
def home_and_here(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A home folder ("~") and a current folder, both new and apart: what a "~" path wrote where."""
    home, here = tmp_path / "home", tmp_path / "here"
    home.mkdir()
    here.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(here)
    return home, here


def test_bench_checks_and_writes_the_same_home_folder_for_a_tilde(small_corpus, home_and_here, monkeypatch):
    """bench --out '~/b': the checks looked at the home folder, the rows and reports went to "./~/b"."""
    import memtrain.commands.bench as bench_command

    home, here = home_and_here
    seen = []

    class Stop(Exception):
        pass

    def fake_run_bench(opts, on_row=None, **resolved):
        seen.append(opts.out)
        raise Stop

    monkeypatch.setattr(bench_command, "run_bench", fake_run_bench)
    main(["bench", "--techniques", "baseline", "--out", "~/b", "--no-maxbatch", "--data", str(small_corpus),
          "--steps", "2", "--no-progress"])  # stopped where the rows would start
    assert seen == [home / "b"] and list(here.iterdir()) == []


def test_every_verb_reads_and_writes_a_tilde_path_in_the_home_folder(tiny_run, home_and_here, capsys):
    """export checked '~/e' in the home folder and wrote "./~/e"; export and generate could not find
    '~/ck.pt', report '~/b', while train's --resume could; flops --plot wrote "./~/f.png"."""
    home, here = home_and_here
    assert main(["train", *cli_flags({**tiny_run, "steps": 1, "warmup_steps": 0, "save": "~/ck.pt"})]) == 0
    assert main(["export", "~/ck.pt", "~/e"]) == 0
    assert (home / "e" / "config.json").is_file()
    assert main(["generate", "~/e", "--max-new-tokens", "2"]) == 0
    assert main(["generate", "~/ck.pt", "--max-new-tokens", "2"]) == 0
    (home / "b").mkdir()
    shutil.copy(Path(__file__).parent / "data" / "bench_results.jsonl", home / "b" / "results.jsonl")
    assert main(["report", "~/b"]) == 0
    assert main(["flops", *cli_flags({k: tiny_run[k] for k in ("d_model", "n_heads", "n_layers", "d_ff")}),
                 "--seq-len", "16", "--batch-size", "1", "--plot", "~/f.png"]) == 0
    assert (home / "f.png").is_file() and list(here.iterdir()) == []


def test_text_from_results_is_escaped_in_markdown_and_csv(tmp_path, capsys):
    out = _bench_folder(tmp_path, technique="=HYPERLINK(\"http://e.x\")", description=ATTACK)
    assert main(["report", str(out)]) == 0
    capsys.readouterr()
    md = (out / "report.md").read_text()
    # The attacker's newline, backticks, pipes, tags and terminal escape stay inside one cell.
    assert "\n`touch" not in md and "`touch" not in md.replace("\\`touch", "")
    assert "<img" not in md and "\x1b" not in md and "[link]" not in md
    row = next(line for line in md.splitlines() if "touch /tmp/pwned" in line)
    assert row.startswith("| x \\`touch /tmp/pwned\\` #\\| &lt;img")
    header = md.splitlines()[md.splitlines().index(row) - 2]
    unescaped_pipes = lambda s: len(s.replace("\\|", "")) - len(s.replace("\\|", "").replace("|", ""))  # noqa: E731
    assert unescaped_pipes(row) == unescaped_pipes(header)  # the table keeps its columns
    # CSV: the csv module's quoting keeps the newline inside its cell; a formula is text.
    records = list(csv.DictReader(io.StringIO((out / "report.csv").read_text())))
    assert len(records) == 3
    assert records[0]["technique"] == "'=HYPERLINK(\"http://e.x\")" and records[0]["method"] == ATTACK
    assert records[1]["estimate_error"].startswith("0.03")  # numbers are left as numbers


def test_a_dollar_in_a_technique_name_does_not_break_the_plots(tmp_path, capsys):
    out = _bench_folder(tmp_path, technique="a $x_{$")  # not valid mathtext
    assert main(["report", str(out)]) == 0
    assert (out / "peak_memory.png").stat().st_size > 10_000


# --------------------------------------------------------------------------- 2. what --save may replace
def _device_node(path: Path) -> Path:
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null of our own
    except (PermissionError, OSError):
        pytest.skip("creating a device node needs root")
    return path


@pytest.mark.parametrize("target", ["fifo", "device", "link", "folder", "foreign", "data", "result.json",
                                    "metrics.jsonl", ".memtrain.lock", "report.md"])
def test_save_refuses_what_it_must_not_replace_before_the_first_step(tiny_run, tmp_path, capsys, target):
    out = Path(tiny_run["out"])
    out.mkdir()
    (tmp_path / "victim.txt").write_text("precious\n")
    save = tmp_path / "ck.pt"
    if target == "fifo":
        os.mkfifo(save)
    elif target == "device":
        _device_node(save)
    elif target == "link":
        save.symlink_to(tmp_path / "victim.txt")
    elif target == "folder":
        save.mkdir()
    elif target == "foreign":
        save.write_text("my notes\n")
    elif target == "data":
        save = Path(tiny_run["data"])
    else:
        save = out / target
        save.write_text("")  # even empty: the name belongs to memtrain's own files in --out
    before = os.lstat(save)
    assert main(["train", *cli_flags({**tiny_run, "steps": 2, "save": str(save)})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--save" in line
    after = os.lstat(save)
    assert (after.st_mode, after.st_ino, after.st_size) == (before.st_mode, before.st_ino, before.st_size)
    assert (tmp_path / "victim.txt").read_text() == "precious\n"
    assert not (out / "metrics.jsonl").exists() or target == "metrics.jsonl"  # refused before the first step


def test_save_replaces_an_empty_file_and_its_own_checkpoint(tiny_run, tmp_path):
    save = tmp_path / "ck.pt"
    save.write_bytes(b"")  # e.g. made by mktemp: nothing to lose
    assert main(["train", *cli_flags({**tiny_run, "steps": 2, "save": str(save)})]) == 0
    first = save.stat().st_mtime_ns
    run2 = {**tiny_run, "steps": 2, "save": str(save), "out": str(tmp_path / "run2")}
    assert main(["train", *cli_flags(run2)]) == 0  # a memtrain checkpoint is replaced
    assert save.stat().st_mtime_ns >= first and save.stat().st_size > 1000


def test_save_refuses_the_checkpoint_of_a_different_run(tiny_run, tmp_path, capsys):
    ck = tmp_path / "ck.pt"
    first = {**tiny_run, "steps": 2, "save": str(ck)}
    assert main(["train", *cli_flags(first)]) == 0
    saved = ck.read_bytes()
    other = {**first, "steps": 3, "out": str(tmp_path / "other")}
    capsys.readouterr()
    assert main(["train", *cli_flags(other)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--save" in line and "checkpoint of a different run" in line and "steps: 2 -> 3" in line, line
    assert ck.read_bytes() == saved
    assert not (tmp_path / "other" / "metrics.jsonl").exists()  # refused before the first step
    # The same run (only where it writes differs) replaces its own checkpoint.
    assert main(["train", *cli_flags({**first, "out": str(tmp_path / "again")})]) == 0


# --------------------------------------------------------------------------- 3. a second run on the same --out
def test_a_fresh_run_on_a_folder_with_results_is_refused_and_resume_appends(tiny_run, tmp_path, capsys):
    out = Path(tiny_run["out"])
    ck = tmp_path / "ck.pt"
    half = {**tiny_run, "steps": 4, "stop_after": 2, "save": str(ck)}
    assert main(["train", *cli_flags(half)]) == 0
    curve, result = (out / "metrics.jsonl").read_bytes(), (out / "result.json").read_bytes()
    capsys.readouterr()
    assert main(["train", *cli_flags({**tiny_run, "steps": 2})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "already holds result.json and metrics.jsonl" in line and "--resume" in line
    assert (out / "metrics.jsonl").read_bytes() == curve and (out / "result.json").read_bytes() == result
    # Without result.json (a failed run) the curve is still kept.
    (out / "result.json").unlink()
    assert main(["train", *cli_flags({**tiny_run, "steps": 2})]) == 2
    assert "metrics.jsonl" in _one_error_line(capsys.readouterr().err)
    assert (out / "metrics.jsonl").read_bytes() == curve
    # --resume onto the same folder continues the curve. A run killed past its last checkpoint
    # had logged step 3 already: that line stays, and the resumed run's first line says where
    # it continued from, so the repeated step is told apart.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n")
    assert main(["train", *cli_flags({**half, "stop_after": 4, "resume": str(ck)})]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [(x["step"], x.get("resumed_from_step")) for x in lines if "loss" in x]  # the training lines
    assert steps == [(1, None), (2, None), (3, None), (3, 2), (4, None)]
    assert sum("resumed_from_step" in x for x in lines) == 1


def test_a_resume_onto_a_huge_result_json_is_refused_before_reading_it(tiny_run, tmp_path, capsys, monkeypatch):
    """A resumed run read the result.json in its --out whole (to compare its run with its own): a
    huge or sparse one went into memory, as bytes and then text. One over the limit is refused from
    its size, unread and kept."""
    from memtrain.files import results

    monkeypatch.setattr(results, "MAX_WHOLE_JSON_BYTES", 1 << 20)  # 1 MiB: a fast test
    out, ck = Path(tiny_run["out"]), tmp_path / "ck.pt"
    half = {**tiny_run, "steps": 4, "stop_after": 2, "save": str(ck)}
    assert main(["train", *cli_flags(half)]) == 0
    with open(out / "result.json", "ab") as f:
        f.truncate(2 << 20)  # sparse
    capsys.readouterr()
    assert main(["train", *cli_flags({**half, "stop_after": 4, "resume": str(ck)})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "holds a result.json of 2,097,152 bytes, more than memtrain reads back" in line, line
    assert (out / "result.json").stat().st_size == 2 << 20


def test_a_tilde_in_out_and_save_is_the_home_folder_for_the_checks_and_the_writes(tiny_run, home_and_here, capsys):
    """--out '~/r' (quoted, or from a config file): the checks looked in the home folder and the
    run wrote into a folder named "~" in the current one, so a second run passed the fresh-folder
    check and was stopped only at its metrics file."""
    home, here = home_and_here
    run = {**tiny_run, "steps": 2, "warmup_steps": 1, "out": "~/r", "save": "~/r/ck.pt"}
    assert main(["train", *cli_flags(run)]) == 0
    assert sorted(p.name for p in (home / "r").iterdir()) == [".memtrain.lock", "ck.pt", "metrics.jsonl", "result.json"]
    assert list(here.iterdir()) == []
    capsys.readouterr()
    assert main(["train", *cli_flags(run)]) == 2
    assert "already holds result.json and metrics.jsonl" in _one_error_line(capsys.readouterr().err)


NO_USER = "~memtrain-no-such-user"


@pytest.mark.parametrize("where", ["--out", "--save", "--data", "--cache-dir", "MEMTRAIN_CACHE", "info", "--plot"])
def test_a_path_in_the_home_of_an_unknown_user_is_one_line(tiny_run, tmp_path, capsys, monkeypatch, where):
    """A path starting with "~user" for a user this system does not know: pathlib's expanduser
    raised RuntimeError deep inside the run ("Could not determine home directory.", exit 1, no
    path named). One line naming the flag (or the variable) and the user, exit 2, nothing made."""
    run = {**tiny_run, "steps": 1, "warmup_steps": 1}
    path = f"{NO_USER}/x"
    if where in ("MEMTRAIN_CACHE", "info"):
        monkeypatch.setenv("MEMTRAIN_CACHE", path)
        argv = ["info"] if where == "info" else ["train", *cli_flags(run)]
        named = "environment variable MEMTRAIN_CACHE"
    elif where == "--plot":
        argv, named = ["flops", "--plot", f"{path}.png"], "argument --plot"
    else:
        argv, named = ["train", *cli_flags({**run, where.lstrip("-").replace("-", "_"): path})], where
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own line
        code = exc.code
    assert code == 2
    line = _one_error_line(capsys.readouterr().err)
    assert named in line and "home folder of user 'memtrain-no-such-user'" in line and "give the full path" in line
    assert not Path(tiny_run["out"]).exists()


def test_a_run_that_fails_before_its_first_step_leaves_no_metrics_file_to_block_the_next(tiny_run, monkeypatch,
                                                                                          capsys):
    """A first step that failed (out of memory) left an empty metrics.jsonl, and the same command
    with a smaller batch was then refused: "--out already holds metrics.jsonl of an earlier run"."""
    import memtrain.training.train as train_module

    out = Path(tiny_run["out"])
    real_run = train_module._Loop.run

    def fail(self, *args, **kwargs):
        raise RuntimeError("the first step failed")

    monkeypatch.setattr(train_module._Loop, "run", fail)
    assert main(["train", *cli_flags(tiny_run)]) == 1
    assert "the first step failed" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()
    monkeypatch.setattr(train_module._Loop, "run", real_run)
    assert main(["train", *cli_flags({**tiny_run, "steps": 2})]) == 0


@pytest.mark.parametrize("logger", ["tensorboard", "wandb"])
def test_a_link_at_a_loggers_folder_is_refused_before_anything_is_written(tiny_run, tmp_path, logger, capsys):
    """OUT/tensorboard planted as a link: --report-to tensorboard wrote its event file into the target."""
    out, victim = Path(tiny_run["out"]), tmp_path / "victim"
    out.mkdir()
    victim.mkdir()
    (out / logger).symlink_to(victim, target_is_directory=True)
    assert main(["train", *cli_flags({**tiny_run, "report_to": logger})]) == 2
    assert f"{logger} (where --report-to {logger} writes) is a symbolic link" in _one_error_line(capsys.readouterr().err)
    assert list(victim.iterdir()) == [] and [p.name for p in out.iterdir()] == [logger]


def test_a_resumed_run_continues_its_own_folder_but_not_another_runs(tiny_run, tmp_path, capsys):
    """--resume replaces result.json and appends to metrics.jsonl: in the resumed run's own folder
    (its result.json records the same settings) that continues the run; in a folder another run
    wrote, it would replace that run's result and extend its curve, so it is refused in one line
    and both files stay as they were."""
    ck = tmp_path / "ck.pt"
    half = {**tiny_run, "steps": 4, "stop_after": 2, "save": str(ck)}
    assert main(["train", *cli_flags(half)]) == 0
    other = {**tiny_run, "steps": 3, "out": str(tmp_path / "other")}
    assert main(["train", *cli_flags(other)]) == 0
    other_out = Path(other["out"])
    curve, result = (other_out / "metrics.jsonl").read_bytes(), (other_out / "result.json").read_bytes()
    capsys.readouterr()
    assert main(["train", *cli_flags({**half, "stop_after": 4, "resume": str(ck), "out": other["out"]})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "holds the result.json of a different run" in line and "steps: 3 -> 4" in line, line
    assert (other_out / "metrics.jsonl").read_bytes() == curve and (other_out / "result.json").read_bytes() == result
    # Its own folder, result.json and all: continued.
    assert main(["train", *cli_flags({**half, "stop_after": 4, "resume": str(ck)})]) == 0
    resumed = json.loads((Path(tiny_run["out"]) / "result.json").read_text())
    assert resumed["steps_run"] == 2 and len(resumed["loss_history"]) == 4


# --------------------------------------------------------------------------- 4. links inside --out
@pytest.mark.parametrize("name", [".memtrain.lock", "metrics.jsonl", "result.json"])
def test_train_refuses_a_link_inside_its_out_folder(tiny_run, tmp_path, capsys, name):
    out = Path(tiny_run["out"])
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (out / name).symlink_to(victim)
    code = main(["train", *cli_flags({**tiny_run, "steps": 2})])
    line = _one_error_line(capsys.readouterr().err)
    assert code == 2 and name in line and "symbolic link" in line
    assert victim.read_text() == "precious\n"


def test_appends_and_the_lock_never_follow_a_link(tmp_path):
    from memtrain.config.run import ConfigError
    from memtrain.files.lock import FolderLock
    from memtrain.files.results import append_jsonl

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "results.jsonl").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        append_jsonl(tmp_path / "results.jsonl", {"technique": "x"})
    lock_dir = tmp_path / "out"
    lock_dir.mkdir()
    (lock_dir / ".memtrain.lock").symlink_to(victim)
    with pytest.raises(ConfigError, match="symbolic link"):
        with FolderLock(lock_dir):
            pass
    assert victim.read_text() == "precious\n"


# --------------------------------------------------------------------------- 5. a full disk on one path
def _fsync_fails_for(monkeypatch, *names: str) -> None:
    """os.fsync raises ENOSPC for a file whose (temporary) name starts with one of ``names``."""
    real = os.fsync

    def fsync(fd: int) -> None:
        target = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
        if target.startswith(names):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_a_full_out_disk_still_writes_the_checkpoint_and_names_the_path(tiny_run, tmp_path, capsys, monkeypatch):
    elsewhere = tmp_path / "other-disk"
    ck = elsewhere / "ck.pt"
    _fsync_fails_for(monkeypatch, "result.json")
    assert main(["train", *cli_flags({**tiny_run, "steps": 2, "save": str(ck)})]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: disk full writing ") and str(Path(tiny_run["out"]) / "result.json") in line
    assert ck.stat().st_size > 1000  # the checkpoint on the other file system was written
    assert not (Path(tiny_run["out"]) / "result.json").exists()
    assert not [p for p in Path(tiny_run["out"]).iterdir() if p.name.endswith(".tmp")]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_when_both_writes_fail_the_line_names_both(tiny_run, tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck.pt"
    _fsync_fails_for(monkeypatch, "result.json", "ck.pt")
    assert main(["train", *cli_flags({**tiny_run, "steps": 2, "save": str(ck)})]) == 1
    line = _one_error_line(capsys.readouterr().err)
    assert str(Path(tiny_run["out"]) / "result.json") in line and str(ck) in line


def test_a_failing_metrics_log_does_not_lose_the_run(tiny_run, tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck.pt"
    calls = []

    def full(fd, data, path):
        calls.append(path)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr("memtrain.training.sinks.write_all", full)
    assert main(["train", *cli_flags({**tiny_run, "steps": 3, "save": str(ck)})]) == 1
    err = capsys.readouterr().err
    assert len(calls) == 1  # said once, then no more attempts
    assert "warning: cannot write" in err and err.strip().splitlines()[-1].startswith("error: disk full writing ")
    assert str(Path(tiny_run["out"]) / "metrics.jsonl") in err.strip().splitlines()[-1]
    assert json.loads((Path(tiny_run["out"]) / "result.json").read_text())["steps"] == 3 and ck.is_file()


# --------------------------------------------------------------------------- 6. kills mid-save, torn lines
_KILLED_AT_SAVE = textwrap.dedent("""
    import os, signal, sys
    import memtrain.checkpoints.exact as c
    def save(obj, f):  # f: the temporary file memtrain opened
        f.write(b"half a checkpoint")
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    c.torch.save = save
    from memtrain.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_temporary_files_of_a_killed_save_are_removed_by_the_next_run(tiny_run, tmp_path):
    ck = tmp_path / "ck.pt"
    run = {**tiny_run, "steps": 2, "save": str(ck)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT_SAVE, "train", *cli_flags(run)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert proc.returncode == -9, proc.stderr
    stale = [p for p in tmp_path.iterdir() if p.name.startswith("ck.pt.") and p.name.endswith(".tmp")]
    assert len(stale) == 1 and not ck.exists()
    # Files that only look alike, and a temporary file of a live writer, are kept.
    decoys = [tmp_path / "ck.pt.notes.tmp", tmp_path / f"ck.pt.memtrain-{os.getppid()}.abcdefgh.tmp"]
    for d in decoys:
        d.write_text("keep")
    shutil.copy(stale[0], tmp_path / "ck.pt.backup")
    assert main(["train", *cli_flags({**run, "out": str(tmp_path / "run2")})]) == 0
    assert not stale[0].exists() and all(d.exists() for d in decoys) and (tmp_path / "ck.pt.backup").exists()
    assert ck.stat().st_size > 1000


def test_stale_temporary_files_in_out_are_removed_when_the_folder_is_taken(tiny_run, tmp_path):
    out = Path(tiny_run["out"])
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = out / f"result.json.memtrain-{dead}.k2j4h5g6.tmp"
    stale.write_text("{half")
    keep = out / "result.json.mine.tmp"
    keep.write_text("user file")
    assert main(["train", *cli_flags({**tiny_run, "steps": 2})]) == 0
    assert not stale.exists() and keep.exists()


def test_a_temporary_file_naming_a_pid_no_process_can_have_is_stale(tiny_run):
    """A leftover NAME.memtrain-PID.RANDOM.tmp whose PID is past a C int (a copied or hand-made
    file) ended every train on that --out with "OverflowError: Python int too large to convert to
    C long" (exit 1) before its first step; one naming pid 0 was kept, since kill(0, 0) asks about
    our own process group. Both name no writer: removed, and the run trains."""
    out = Path(tiny_run["out"])
    out.mkdir()
    huge, zero = out / "result.json.memtrain-99999999999999999999.k2j4h5g6.tmp", out / "result.json.memtrain-0.a1b2c3d4.tmp"
    for stale in (huge, zero):
        stale.write_text("{half")
    assert main(["train", *cli_flags({**tiny_run, "steps": 2})]) == 0
    assert not huge.exists() and not zero.exists() and (out / "result.json").is_file()


def test_resume_after_a_torn_metrics_line_starts_a_new_line(tiny_run, tmp_path):
    out = Path(tiny_run["out"])
    ck = tmp_path / "ck.pt"
    half = {**tiny_run, "steps": 4, "stop_after": 2, "save": str(ck)}
    assert main(["train", *cli_flags(half)]) == 0
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 3, "lo')  # killed mid-line
    assert main(["train", *cli_flags({**half, "stop_after": 4, "resume": str(ck)})]) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert '{"step": 3, "lo' in lines  # the torn line stays alone
    parsed = [json.loads(line) for line in lines if line != '{"step": 3, "lo']
    assert {p["step"] for p in parsed} == {1, 2, 3, 4}


def test_links_planted_in_the_out_folder_during_the_run_are_replaced_not_followed(tiny_run, tmp_path, capsys,
                                                                                   monkeypatch):
    """Links planted at result.json and at --save after the run checked them (another user, a
    script): the run trained every step and then refused to write (exit 2), losing its result and
    its checkpoint. They are replaced by the files, their targets untouched, with a warning."""
    import torch

    import memtrain.cli as cli

    out = Path(tiny_run["out"])
    ckpt = out / "c.pt"
    victim, victim2 = tmp_path / "victim", tmp_path / "victim2"
    victim.write_text("precious\n")

    def plant(done: int, total: int, median_s) -> None:
        if done == 1:
            (out / "result.json").symlink_to(victim)
            ckpt.symlink_to(victim2)  # a link to a file that does not exist yet

    monkeypatch.setattr(cli, "_warn_after_first_step", lambda warning: plant)
    assert main(["train", *cli_flags({**tiny_run, "steps": 3, "save": str(ckpt)})]) == 0
    err = capsys.readouterr().err
    assert err.count("became a symbolic link") == 2, err
    assert not (out / "result.json").is_symlink() and json.loads((out / "result.json").read_text())["steps"] == 3
    assert not ckpt.is_symlink() and torch.load(ckpt, weights_only=True)["step"] == 3
    assert victim.read_text() == "precious\n" and not victim2.exists()


def test_links_planted_in_a_bench_folder_between_rows_are_replaced_not_followed(small_corpus, tmp_path, capsys,
                                                                                monkeypatch):
    """Links planted at results.jsonl and report.md after the bench's first row (the bench refused
    them before it started): the next row ran, then its line was refused and the bench ended (exit 2),
    losing the row. The links are replaced, their targets untouched, and every row is kept."""
    import memtrain.bench.runner as runner

    out = tmp_path / "b"
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    real = runner.write_report
    calls = []

    def plant_after_the_first_row(*args, **kwargs):
        summary = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            (out / "results.jsonl").rename(tmp_path / "kept.jsonl")
            (out / "results.jsonl").symlink_to(victim)
            (out / "report.md").unlink()
            (out / "report.md").symlink_to(victim)
        return summary

    monkeypatch.setattr(runner, "write_report", plant_after_the_first_row)
    assert main(["bench", "--techniques", "baseline,precision=bf16", "--out", str(out), "--no-maxbatch",
                 "--data", str(small_corpus), "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                 "--d-model", "32", "--n-heads", "4", "--n-layers", "2", "--d-ff", "64", "--max-seq-len", "64",
                 "--no-progress"]) == 1  # the first row's line went away with the moved file
    err = capsys.readouterr().err
    assert err.count("became a symbolic link") == 2, err
    assert err.strip().splitlines()[-1] == "error: partial report: no row for baseline"
    assert victim.read_text() == "precious\n"
    assert not (out / "results.jsonl").is_symlink() and not (out / "report.md").is_symlink()
    assert [json.loads(line)["technique"] for line in (out / "results.jsonl").read_text().splitlines()] == [
        "precision=bf16"]
    assert "bf16" in (out / "report.md").read_text().lower()


def test_a_fifo_planted_at_metrics_jsonl_during_the_run_is_never_opened(tiny_run, capsys, monkeypatch):
    """A FIFO put where metrics.jsonl was: the curve stops there with a warning (a FIFO is never
    opened: a write would block the run), the run writes its result and says so in its last line."""
    import memtrain.cli as cli

    out = Path(tiny_run["out"])

    def plant(done: int, total: int, median_s) -> None:
        if done == 1:
            (out / "metrics.jsonl").unlink()
            os.mkfifo(out / "metrics.jsonl")

    monkeypatch.setattr(cli, "_warn_after_first_step", lambda warning: plant)
    assert main(["train", *cli_flags({**tiny_run, "steps": 3})]) == 2
    err = capsys.readouterr().err
    assert "warning: cannot write" in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error:") and "metrics.jsonl" in err.strip().splitlines()[-1]
    assert json.loads((out / "result.json").read_text())["steps"] == 3
    assert stat.S_ISFIFO(os.lstat(out / "metrics.jsonl").st_mode)


@pytest.mark.parametrize("how", ["link", "removed", "replaced", "moved"])
def test_metrics_jsonl_replaced_during_the_run_keeps_every_line(tiny_run, tmp_path, capsys, monkeypatch, how):
    """metrics.jsonl removed, replaced by another file or by a planted link after the first step: the
    run kept writing into the file it had open, no longer in the folder, and every later line was
    lost (a link's target was left alone). The name is followed as result.json's is: a link is
    replaced, not followed; lines of a file no longer anywhere are copied into the new one."""
    import memtrain.cli as cli

    out = Path(tiny_run["out"])
    victim = tmp_path / "victim"
    victim.write_text("precious\n")

    def plant(done: int, total: int, median_s) -> None:
        if done != 1:
            return
        metrics = out / "metrics.jsonl"
        if how == "moved":
            metrics.rename(tmp_path / "moved.jsonl")
        else:
            metrics.unlink()
        if how == "link":
            metrics.symlink_to(victim)
        elif how == "replaced":
            metrics.write_text('{"note": "theirs"}\n')

    monkeypatch.setattr(cli, "_warn_after_first_step", lambda warning: plant)
    assert main(["train", *cli_flags({**tiny_run, "steps": 3})]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert victim.read_text() == "precious\n"
    metrics = out / "metrics.jsonl"
    assert not metrics.is_symlink()
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in lines if "loss" in r]  # the step lines (the last evaluation's has val_loss)
    assert lines[-1]["step"] == 3 and "val_loss" in lines[-1]
    if how == "moved":  # the earlier line is where it was moved to; the rest continue at the name
        assert [json.loads(x)["step"] for x in (tmp_path / "moved.jsonl").read_text().splitlines()] == [1]
        assert steps == [2, 3]
    else:
        assert steps == [1, 2, 3], lines
    if how == "replaced":
        assert lines[0] == {"note": "theirs"}
    assert "metrics.jsonl" in err and ("became a symbolic link" in err) == (how == "link"), err


def test_a_save_name_whose_temporary_file_would_be_too_long_is_refused_before_the_first_step(tiny_run, tmp_path,
                                                                                              capsys):
    """A --save name of 235 bytes is a valid name, but the temporary file memtrain writes it
    through (NAME.memtrain-PID.RANDOM.tmp) is not: the run trained every step, wrote
    result.json, then lost its checkpoint to ENAMETOOLONG. Refused up front, nothing written;
    a name that leaves room still trains."""
    out = tmp_path / "run"
    save = out / ("s" * 232 + ".pt")
    assert main(["train", *cli_flags({**tiny_run, "steps": 1, "warmup_steps": 0, "save": str(save)})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--save: the name" in line and "over the 255 a name may have here; shorten the name to at most 225" in line
    assert not out.exists()
    fits = out / ("s" * 222 + ".pt")
    assert main(["train", *cli_flags({**tiny_run, "steps": 1, "warmup_steps": 0, "save": str(fits)})]) == 0
    assert fits.is_file()


def test_an_out_path_too_long_for_the_result_is_refused_before_the_first_step(tiny_run, tmp_path, capsys):
    """An --out path the system takes (its lock and metrics.jsonl fit) but result.json's
    temporary file does not: the run trained and then lost its result. Refused up front."""
    room = 4096 - len(os.fsencode(str(tmp_path))) - 1 - len("result.json.memtrain-9999999.xxxxxxxx.tmp") + 10
    parts, left = [], room
    while left > 0:
        parts.append("d" * min(200, left))
        left -= len(parts[-1]) + 1
    out = tmp_path.joinpath(*parts)
    assert len(os.fsencode(str(out / ".memtrain.lock"))) < 4096  # the lock alone would fit
    assert main(["train", *cli_flags({**tiny_run, "steps": 1, "warmup_steps": 0, "out": str(out)})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "the path of result.json there, with its temporary name" in line and "give a shorter path" in line
    assert not (tmp_path / parts[0]).exists()


def test_a_bench_out_too_long_for_a_rows_files_is_refused_before_the_first_row(small_corpus, tmp_path, capsys):
    """The bench checked the room of the names it writes at the top of --out, while each row's
    train writes in OUT/rows/NAME and checked that itself when it ran: a long --out with a long row
    name ran the rows before it, then refused that row (exit 1). Refused before any row."""
    from memtrain.config.run import ConfigError
    from memtrain.training.preflight import check_folder_room

    length = 4036  # baseline's files fit (4,094 bytes with the temporary name), chunked-loss's do not
    parts, left = [], length - len(os.fsencode(str(tmp_path))) - 1
    while left > 0:
        parts.append("d" * min(200, left - 2 if 0 < left - 200 < 2 else left))
        left -= len(parts[-1]) + 1
    out = tmp_path.joinpath(*parts)
    assert len(os.fsencode(str(out))) == length
    assert main(["bench", "--techniques", "baseline,chunked-loss", "--out", str(out), "--no-maxbatch",
                 "--data", str(small_corpus), "--steps", "1", "--no-progress"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: --out (row chunked-loss)") and "give a shorter path" in line
    assert not (tmp_path / parts[0]).exists()  # no row ran, nothing was written
    with pytest.raises(ConfigError, match="the folder name .* has 300 bytes, over the 255"):
        check_folder_room(tmp_path / "rows" / ("r" * 300), ["result.json"], "--out")


def test_a_name_too_long_for_the_system_is_one_line_saying_so(tiny_run, tmp_path, capsys):
    """A name over 255 bytes (--out, --data) was exit 1 with Python's
    "OSError: [Errno 36] File name too long" and the whole path; it is bad input, one line that
    says to shorten it, the path cut to its ends."""
    long = tmp_path / ("x" * 300)
    run = {**tiny_run, "steps": 1, "warmup_steps": 0}
    for argv in (["train", *cli_flags({**run, "out": str(long)})],
                 ["train", *cli_flags({**run, "data": str(long) + ".txt"})]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert line.startswith("error: file name too long") and "give memtrain a shorter path" in line
        assert len(line) < 400


def test_an_out_folder_the_data_reads_is_refused_before_anything_is_written(tiny_run, tmp_path, capsys):
    """`--data corpus --out corpus/run` (or `--out corpus`, or a glob matching what memtrain
    writes) trained, then the next run or a resume read result.json and metrics.jsonl as text
    (or refused: the data changed). Refused up front by train and bench; the data is untouched."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(tiny_run["data"], corpus / "a.txt")
    (corpus / "b.jsonl").write_text(json.dumps({"text": "one document " * 50}) + "\n")
    run = {**tiny_run, "steps": 1, "warmup_steps": 0, "val_fraction": 0.5}
    cases = [(str(corpus), corpus / "run", "result.json"), (str(corpus), corpus, "result.json"),
             (str(corpus / "*.jsonl"), corpus, "metrics.jsonl")]
    for data, out, name in cases:
        assert main(["train", *cli_flags({**run, "data": data, "out": str(out)})]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"is where --data {data!r} reads: the {name} memtrain writes there" in line
    assert main(["bench", "--techniques", "baseline", "--no-maxbatch", "--data", str(corpus),
                 "--out", str(corpus / "bench"), *cli_flags({k: v for k, v in run.items() if k not in ("data", "out")})]) == 2
    assert "is where --data" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt", "b.jsonl"]
    # An --out beside the data, and a glob that cannot match what memtrain writes there, train.
    assert main(["train", *cli_flags({**run, "data": str(corpus), "out": str(tmp_path / "beside")})]) == 0
    assert main(["train", *cli_flags({**run, "data": str(corpus / "*.txt"), "out": str(corpus / "run")})]) == 0


def test_an_out_folder_a_recursive_data_glob_reads_is_refused(tiny_run, tmp_path, capsys):
    """`--data 'corpus/**/*.jsonl' --out corpus/deep/run` trained: the check took `**` for one
    folder level (pathlib's match on Python 3.11), while the data's glob reads any depth, so the
    next run read metrics.jsonl as text to train on. The check now lists what glob lists."""
    import glob

    from memtrain.training.preflight import glob_lists

    corpus = tmp_path / "corpus"
    files = ["a.jsonl", "deep/run/metrics.jsonl", "deep/b.txt", "deep/.x.jsonl", ".hidden/run/metrics.jsonl",
             "deep/er/run/result.json"]
    for name in files:
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_text("x")
    patterns = ["**/*.jsonl", "**", "*/*.jsonl", "**/run/*.jsonl", ".hidden/**/*.jsonl", "**/.x.jsonl", "*.jsonl",
                "**/**/*.jsonl", "d*/**/metrics.jsonl", "deep/**/run/*.json", "**/r?n/*", "deep/[ab]*"]
    for pattern in patterns:
        listed = set(glob.glob(str(corpus / pattern), recursive=True))
        for name in files:
            assert glob_lists(corpus / pattern, corpus / name) == (str(corpus / name) in listed), (pattern, name)

    data = str(corpus / "**" / "*.jsonl")
    shutil.copy(tiny_run["data"], corpus / "deep" / "c.jsonl")
    run = {**tiny_run, "data": data, "steps": 1, "warmup_steps": 0, "val_fraction": 0.5}
    assert main(["train", *cli_flags({**run, "out": str(corpus / "deep" / "new")})]) == 2
    assert f"is where --data {data!r} reads: the metrics.jsonl memtrain writes there" in _one_error_line(
        capsys.readouterr().err)
    assert not (corpus / "deep" / "new").exists()


def test_an_out_the_data_reads_through_a_link_or_dotdot_is_refused(tiny_run, tmp_path, capsys):
    """The data named through a link to its folder, or with "..", and the --out named plainly (or
    the reverse): two spellings of one folder, compared as text, so the run trained and the next
    one read its metrics.jsonl as data. Both sides are resolved first."""
    corpus = tmp_path / "corpus"
    (corpus / "deep").mkdir(parents=True)
    shutil.copy(tiny_run["data"], corpus / "a.txt")
    (corpus / "deep" / "b.jsonl").write_text(json.dumps({"text": "one document " * 50}) + "\n")
    link = tmp_path / "link"
    link.symlink_to(corpus, target_is_directory=True)
    run = {**tiny_run, "steps": 1, "warmup_steps": 0, "val_fraction": 0.5}
    cases = [(str(link), corpus / "run"), (str(corpus), link / "run"), (str(link / "**" / "*.jsonl"), corpus / "deep" / "run"),
             (str(tmp_path / "deep" / ".." / "corpus" / "**" / "*.jsonl"), corpus / "deep" / "x")]
    for data, out in cases:
        assert main(["train", *cli_flags({**run, "data": data, "out": str(out)})]) == 2, (data, out)
        assert f"is where --data {data!r} reads" in _one_error_line(capsys.readouterr().err)
        assert not out.exists()



def test_an_out_a_data_glob_reads_through_a_link_below_its_wildcard_is_refused(tiny_run, tmp_path, capsys, monkeypatch):
    """A link inside the data below a wildcard part (`corpus/sub` -> `elsewhere`, `--data
    'corpus/**/*.jsonl'`, `--out elsewhere/run`): realpath resolves only the parts before the
    wildcard, so the run trained and the next one's glob read its metrics.jsonl through the link.
    The check walks the folders the glob walks (links followed, as glob follows them) and the
    files it lists now (a link to a file in the --out)."""
    from memtrain.config.run import ConfigError
    from memtrain.files.results import TRAIN_FILES
    from memtrain.training.preflight import check_out_outside_data

    corpus, elsewhere, other = tmp_path / "corpus", tmp_path / "elsewhere", tmp_path / "other"
    for folder in (corpus, elsewhere / "deep", other):
        folder.mkdir(parents=True)
    shutil.copy(tiny_run["data"], corpus / "a.jsonl")
    (corpus / "sub").symlink_to(elsewhere, target_is_directory=True)
    (corpus / ".hid").symlink_to(other, target_is_directory=True)
    (corpus / "m.jsonl").symlink_to(other / "kept" / "metrics.jsonl")  # dangling until a run writes there
    monkeypatch.chdir(tmp_path)
    run = {**tiny_run, "steps": 1, "warmup_steps": 0, "val_fraction": 0.5}
    data = "corpus/**/*.jsonl"
    assert main(["train", *cli_flags({**run, "data": data, "out": str(elsewhere / "run")})]) == 2
    assert f"is where --data {data!r} reads: the metrics.jsonl" in _one_error_line(capsys.readouterr().err)
    assert not (elsewhere / "run").exists()
    refused = [("corpus/**/*.jsonl", elsewhere / "deep" / "x" / "run"), ("corpus/*/*.jsonl", elsewhere),
               (str(corpus / "*" / "*.jsonl"), elsewhere), ("corpus/*.jsonl", other / "kept"),
               ("other/../corpus/**/*.jsonl", elsewhere / "run")]
    for pattern, out in refused:
        with pytest.raises(ConfigError, match="is where --data"):
            check_out_outside_data(out, pattern, TRAIN_FILES)
    # What the glob does not walk stays allowed: one level only, a hidden link (glob skips it),
    # a folder beside the link's target.
    allowed = [("corpus/*.jsonl", elsewhere / "run"), ("corpus/**/*.jsonl", other / "run"),
               ("corpus/*/*.jsonl", elsewhere / "deep"), ("corpus/**/*.jsonl", tmp_path / "elsewhere2")]
    for pattern, out in allowed:
        check_out_outside_data(out, pattern, TRAIN_FILES)

def test_an_out_a_data_folder_reads_through_a_file_link_is_refused(tiny_run, tmp_path, capsys):
    """`--data corpus` (a folder, no wildcard) with `corpus/x.txt -> ../run/metrics.jsonl`: the
    folder reader's rglob lists the link and reads its target, while the check compared folders
    only, so the run trained and the next one read its own loss curve as text. The check looks at
    what the reader lists (the rule the glob case uses), a link that dangles until the run writes
    its target included."""
    from memtrain.config.run import ConfigError
    from memtrain.files.results import TRAIN_FILES
    from memtrain.training.preflight import check_out_outside_data

    corpus, run_dir = tmp_path / "corpus", tmp_path / "run"
    corpus.mkdir()
    shutil.copy(tiny_run["data"], corpus / "a.txt")
    (corpus / "x.txt").symlink_to(Path("..") / "run" / "metrics.jsonl")  # dangling until a run writes it
    run = {**tiny_run, "steps": 1, "warmup_steps": 0, "val_fraction": 0.5}
    assert main(["train", *cli_flags({**run, "data": str(corpus), "out": str(run_dir)})]) == 2
    assert f"is where --data {str(corpus)!r} reads: the metrics.jsonl" in _one_error_line(capsys.readouterr().err)
    assert not run_dir.exists()
    single = tmp_path / "one.jsonl"
    single.symlink_to(run_dir / "result.json")
    with pytest.raises(ConfigError, match="reads: the result.json"):
        check_out_outside_data(run_dir, str(single), TRAIN_FILES)  # a file --data that links there
    # What the folder reader does not list stays allowed: a link whose name it skips (".md").
    (corpus / "x.txt").unlink()
    (corpus / "x.md").symlink_to(run_dir / "metrics.jsonl")
    check_out_outside_data(run_dir, str(corpus), TRAIN_FILES)


@pytest.mark.parametrize("failing", ["second", "every"])
def test_a_periodic_checkpoint_that_cannot_be_written_does_not_stop_the_run(tiny_run, tmp_path, capsys, monkeypatch,
                                                                         failing):
    """A --save-every checkpoint meeting a full disk stopped the run there (exit 1): the steps
    since the last checkpoint and the result were lost. It is said once and training goes on;
    the final save tries again (its own failure still exits 1, after result.json)."""
    import torch

    from memtrain.training import train as train_module

    real, calls = train_module.save_checkpoint, []

    def full_disk(path, state):
        calls.append(state.step)
        if failing == "every" or len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, state)

    monkeypatch.setattr(train_module, "save_checkpoint", full_disk)
    save = tmp_path / "run" / "ck.pt"
    run = {**tiny_run, "steps": 4, "warmup_steps": 0, "save": str(save), "save_every": 1}
    code = main(["train", *cli_flags(run)])
    err = capsys.readouterr().err
    assert calls == [1, 2, 3, 4]  # three periodic saves, then the final one
    assert err.count("warning: the checkpoint of step") == 1
    assert json.loads((tmp_path / "run" / "result.json").read_text())["steps"] == 4
    if failing == "second":
        assert code == 0 and torch.load(save, weights_only=True, mmap=True)["step"] == 4
    else:
        assert code == 1 and "disk full writing" in err.strip().splitlines()[-1] and not save.exists()


SRC = Path(__file__).parents[1] / "src"


def _under_file_size_limit(args: list[str], limit: int, cache: Path) -> subprocess.CompletedProcess:
    """``memtrain ARGS`` in a process whose files may not grow past ``limit`` bytes (``ulimit -f``:
    a write past it fails with EFBIG, Python ignoring SIGXFSZ), on its own token cache."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "MEMTRAIN_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "memtrain", *args], capture_output=True, text=True, env=env,
                          preexec_fn=cap, timeout=600)


def test_a_file_size_limit_at_the_checkpoints_keeps_the_old_one_and_the_run(tiny_run, tmp_path):
    """A checkpoint past the file size limit (`ulimit -f`) made torch.save raise "[enforce fail at
    inline_container.cc] unexpected pos": a --save-every save stopped the run there (the periodic
    save goes on past an OSError only), losing the result, and the line named no file. The write's
    own error (EFBIG) is kept: the periodic save warns, the run writes its result, the final save's
    line names the checkpoint and the limit, and the checkpoint resumed from is untouched."""
    ck = tmp_path / "ck.pt"
    run = {**tiny_run, "steps": 4, "warmup_steps": 1, "save": str(ck)}
    assert main(["train", *cli_flags({**run, "stop_after": 2})]) == 0
    before = ck.read_bytes()
    assert len(before) > 4_000_000  # the limit below binds the checkpoint only
    proc = _under_file_size_limit(["train", "--resume", str(ck), "--out", tiny_run["out"], "--save-every", "1",
                                   "--no-progress"],
                                  4_000_000, tmp_path / "cache")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: file too large writing {ck}: it passed this shell's file size limit")
    assert "Traceback" not in proc.stderr and "warning: the checkpoint of step 3 could not be written" in proc.stderr
    assert ck.read_bytes() == before
    assert json.loads((Path(tiny_run["out"]) / "result.json").read_text())["steps"] == 4
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("ck.pt")] == ["ck.pt"]


def test_a_file_size_limit_in_export_and_the_token_cache_is_one_line_naming_the_place(tiny_run, tmp_path):
    """An export past the file size limit said "SafetensorError: ... File too large (os error 27)",
    a token cache entry past it "OSError: [Errno 27] File too large": neither named the place nor
    what to change. Each is one line naming the export folder or the cache, exit 1, nothing left."""
    ck = tmp_path / "ck.pt"
    assert main(["train", *cli_flags({**tiny_run, "steps": 1, "warmup_steps": 1, "save": str(ck)})]) == 0
    dest = tmp_path / "exported"
    proc = _under_file_size_limit(["export", str(ck), str(dest)], 1_000_000, tmp_path / "cache")
    assert proc.returncode == 1
    assert _one_error_line(proc.stderr).startswith(f"error: file too large writing {dest}: ")
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".memtrain-export")]
    cache, out = tmp_path / "fresh-cache", tmp_path / "limited"
    proc = _under_file_size_limit(["train", *cli_flags({**tiny_run, "out": str(out)})], 16_000, cache)
    assert proc.returncode == 1
    assert _one_error_line(proc.stderr).startswith(f"error: file too large writing {cache}: ")
    assert not out.exists() and not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


def test_a_newline_or_terminal_escape_in_an_out_path_stays_one_wrote_line(small_corpus, tmp_path, capsys):
    """`--out` (and export's folder) may hold any byte but / and NUL: a newline split the last line,
    `wrote OUT/result.json`, in two (a script reading it took the second half for the path), and an
    escape sequence in the name reached the terminal. Both are written as escapes, as the `error:`
    lines write them; the files are written at the name given."""
    out = tmp_path / "run\nx\x1b[2J"
    flags = cli_flags({"d_model": 32, "n_heads": 2, "n_layers": 1, "d_ff": 64, "data": str(small_corpus),
                       "seq_len": 16, "batch_size": 1, "steps": 1, "warmup_steps": 0, "val_blocks": 1,
                       "progress": False, "cache_dir": str(tmp_path / "cache")})
    assert main(["train", *flags, "--out", str(out), "--save", str(out / "c.pt")]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == f"wrote {tmp_path}/run\\nx\\x1b[2J/result.json"
    assert json.loads((out / "result.json").read_text())["steps"] == 1
    pytest.importorskip("transformers")
    hf = tmp_path / "hf\nmodel"
    assert main(["export", str(out / "c.pt"), str(hf)]) == 0
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 1 and wrote[0].startswith(f"wrote {tmp_path}/hf\\nmodel: ") and (hf / "config.json").is_file()
