"""The results store (memtrain.files.results): atomic JSON, torn JSONL lines, the folder lock."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memtrain.cli import main
from memtrain.config.run import ConfigError
from memtrain.files.lock import FolderLock
from memtrain.files.results import append_jsonl, read_jsonl, write_json_atomic

DATA = Path(__file__).parent / "data"


def test_append_after_a_torn_line_starts_a_new_line(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text('{"technique": "a", "status": "ok"}\n{"technique": "b", "sta')  # killed mid-append
    append_jsonl(path, {"technique": "c", "status": "ok"})
    append_jsonl(path, {"technique": "d", "status": "ok"})
    read = read_jsonl(path)
    assert [r["technique"] for r in read.rows] == ["a", "c", "d"]
    assert read.skipped == 1
    assert path.read_text().endswith('"ok"}\n')


def test_non_object_and_non_utf8_lines_are_counted_not_fatal(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'[1]\n"text"\n\xff\xfe garbage\n\n{"technique": "a"}\n')
    read = read_jsonl(path)
    assert read.rows == [{"technique": "a"}] and read.skipped == 3


def test_json_never_holds_nan(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"loss": math.nan, "x": [math.inf, 1.0], "y": {"z": -math.inf}})
    text = (tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"loss": None, "x": [None, 1.0], "y": {"z": None}}
    append_jsonl(tmp_path / "r.jsonl", {"v": math.nan})
    assert json.loads((tmp_path / "r.jsonl").read_text()) == {"v": None}
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".tmp"] == []


def test_report_survives_torn_and_non_object_lines(tmp_path, capsys):
    lines = (DATA / "bench_results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("[1]\n" + "\n".join(lines) + '\n{"technique": "x", "sta')
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "Chunked LM-head loss" in captured.out
    assert "skipped 2 unreadable line(s)" in captured.err


def test_a_line_too_long_for_a_row_is_skipped_without_being_held(tmp_path, capsys, monkeypatch):
    """A 2 GB line in results.jsonl (a sparse or foreign file) took `report` 6 GB of memory and
    28 s to skip: every line was read whole before it was parsed. A line over 16 MiB is read past
    in pieces and counted; the rows around it are read."""
    import tracemalloc

    from memtrain.files import results

    # The file's own size limit (32 MiB) would refuse this 200 MiB file before its lines are read:
    # raised here so that the line bound, which holds under it too, is what is tested.
    monkeypatch.setattr(results, "MAX_JSONL_FILE_BYTES", 1 << 30)

    lines = (DATA / "bench_results.jsonl").read_text().splitlines()
    path = tmp_path / "results.jsonl"
    path.write_text(lines[0] + "\n")
    with open(path, "ab") as f:
        f.truncate(f.tell() + (200 << 20))  # a 200 MiB line of NUL bytes, sparse: nothing written
    with open(path, "a") as f:
        f.write("\n" + "\n".join(lines[1:]) + "\n")
    tracemalloc.start()
    try:
        read = read_jsonl(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (len(read.rows), read.skipped) == (len(lines), 1)
    assert peak < 40 << 20, f"{peak:,} bytes held"  # the 200 MiB line was held whole
    assert main(["report", str(tmp_path)]) == 0
    assert "skipped 1 unreadable line(s)" in capsys.readouterr().err


def test_report_of_a_file_with_no_rows_is_bad_input(tmp_path, capsys):
    (tmp_path / "results.jsonl").write_bytes(b"\x00\x01garbage\n[1, 2]\n")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "holds no rows" in err[0]


@pytest.mark.parametrize("content", [b"", b"\x00garbage\n[1]\n"], ids=["empty", "unreadable"])
def test_report_refused_for_no_rows_keeps_the_report_already_written(tmp_path, capsys, content):
    (tmp_path / "results.jsonl").write_text((DATA / "bench_results.jsonl").read_text())
    assert main(["report", str(tmp_path)]) == 0
    names = ("report.md", "report.csv", "report.json")
    before = {n: (tmp_path / n).read_bytes() for n in names}
    (tmp_path / "results.jsonl").write_bytes(content)
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "holds no rows" in err[0]
    assert {n: (tmp_path / n).read_bytes() for n in names} == before


def test_report_skips_rows_of_the_wrong_shape(tmp_path, capsys):
    lines = (DATA / "bench_results.jsonl").read_text().splitlines()
    bad = [{"technique": "a", "status": "ok", "val_ppl": "x", "memory": {"peak_bytes": "y"}, "step_time_s": 5, "config": 3},
           {"technique": "b", "status": "ok", "memory": None, "max_batch": "z"},
           {"technique": 7, "status": "error"}]
    (tmp_path / "results.jsonl").write_text("\n".join([*lines, *map(json.dumps, bad)]) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "skipped 3 unreadable line(s)" in captured.err and "Chunked LM-head loss" in captured.out
    (tmp_path / "results.jsonl").write_text("\n".join(map(json.dumps, bad)) + "\n")
    assert main(["report", str(tmp_path)]) == 2
    assert "holds no rows (3 unreadable line(s) skipped)" in capsys.readouterr().err


def _bench_holding(folder: Path) -> subprocess.Popen[str]:
    """A child process holding ``folder``'s lock as ``memtrain bench`` would, returned once it
    holds it (kill it to let go)."""
    code = ("import sys, time; from memtrain.files.lock import FolderLock\n"
            "with FolderLock(sys.argv[1], 'memtrain bench'):\n"
            "    print('locked', flush=True); time.sleep(60)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "locked":
        holder.kill()  # it never took the lock: nothing of the test's to hold for it
        holder.wait()
        pytest.fail("the child never took the folder's lock")
    return holder


def test_folder_lock_refuses_a_second_holder_and_frees_on_exit(tmp_path):
    holder = _bench_holding(tmp_path)
    try:
        with pytest.raises(ConfigError, match=rf"in use by memtrain bench \(pid {holder.pid}\)"):
            with FolderLock(tmp_path, "memtrain bench"):
                pass
    finally:
        holder.kill()
        holder.wait()
    with FolderLock(tmp_path, "memtrain bench"):  # the kernel dropped the dead holder's lock
        pass


def test_report_waits_for_a_bench_still_writing_its_folder(tmp_path, capsys):
    """`memtrain report DIR` while a bench runs in DIR built a report from the rows of the moment,
    which could land after the bench's own final report and be the one left. Refused in one line
    while the bench holds the folder, nothing written; it runs once the bench is gone."""
    (tmp_path / "results.jsonl").write_text((DATA / "bench_results.jsonl").read_text())
    holder = _bench_holding(tmp_path)
    try:
        assert main(["report", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is in use by memtrain bench (pid {holder.pid})" in err[0]
        assert not (tmp_path / "report.md").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").is_file()


def test_a_huge_lock_file_is_not_read_whole(tmp_path):
    """A lock file left huge (sparse, 200 MiB of NUL bytes) was read whole, as text, by the next
    run taking the folder: only its first MiB can hold the holder's and the writers' lines."""
    import tracemalloc

    with open(tmp_path / ".memtrain.lock", "wb") as f:
        f.truncate(200 << 20)
    tracemalloc.start()
    try:
        with FolderLock(tmp_path, "memtrain bench"):
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, f"{peak:,} bytes held"
    assert (tmp_path / ".memtrain.lock").stat().st_size < 100  # taken: the holder's line alone


def test_atomic_writes_get_a_plain_files_mode_and_keep_a_replaced_files(tmp_path):
    """result.json, report.md, checkpoints (every atomic write) and an exported model folder were
    owner-only (0600, 0700: mkstemp's and mkdtemp's modes carried through the rename), unreadable
    to the others a shared machine's umask lets read them. A new file gets 0666 less the umask;
    a replaced file keeps its mode."""
    import os
    import stat

    from memtrain.inference.export import _new_directory

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "new.json", {"a": 1})
        assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
        (tmp_path / "mine.json").write_text("{}")
        (tmp_path / "mine.json").chmod(0o640)
        write_json_atomic(tmp_path / "mine.json", {"a": 2})
        assert stat.S_IMODE((tmp_path / "mine.json").stat().st_mode) == 0o640
        os.umask(0o077)
        write_json_atomic(tmp_path / "private.json", {"a": 3})
        assert stat.S_IMODE((tmp_path / "private.json").stat().st_mode) == 0o600
        os.umask(0o002)
        with _new_directory(tmp_path / "exported") as tmp:
            (tmp / "config.json").write_text("{}")
        assert stat.S_IMODE((tmp_path / "exported").stat().st_mode) == 0o775
    finally:
        os.umask(old)


def test_a_report_quoting_a_file_name_that_is_not_utf8_is_written(tmp_path, capsys):
    """A bench on `--data` named with a byte that is not UTF-8 (Python holds it as a lone
    surrogate) records the name; report.md quotes it, and its strict UTF-8 encode made the
    report (and a bench's last step) exit 1 with nothing written. It is written as the escape."""
    rows = [json.loads(line) for line in (DATA / "bench_results.jsonl").read_text().splitlines()]
    for row in rows:
        row["config"].setdefault("data", {})["data"] = "corpus/d\udcff.txt"
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    text = (tmp_path / "report.md").read_text(encoding="utf-8")  # still UTF-8
    assert "corpus/d\\udcff.txt" in text


def test_a_command_printing_a_path_that_is_not_utf8_exits_0_under_a_strict_stdout(tmp_path):
    """A UTF-8 locale's stdout refuses lone surrogates: `train --out` named with a byte that
    is not UTF-8 wrote everything, then failed on its last line ("wrote OUT/result.json"), exit
    1. The line now shows the byte as an escape."""
    out = os.fsdecode(bytes(tmp_path) + b"/o\xfe")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # what a UTF-8 locale gives: strict stdout
    proc = subprocess.run([sys.executable, "-m", "memtrain", "train", "--steps", "1", "--batch-size", "1",
                           "--seq-len", "16", "--d-model", "16", "--n-heads", "2", "--n-layers", "1", "--d-ff", "32",
                           "--val-blocks", "1", "--warmup-steps", "0", "--no-progress", "--out", out,
                           "--cache-dir", str(tmp_path / "cache")], capture_output=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert b"wrote " + bytes(tmp_path) + b"/o\\udcfe/result.json" in proc.stdout
    assert json.loads((Path(out) / "result.json").read_text())["steps"] == 1


def test_read_result_returns_only_a_json_object_it_may_read(tmp_path, monkeypatch):
    """results.read_result: the object in FOLDER/result.json, None for anything else (absent, not
    an object, not JSON, a FIFO, a link out of the folder, over MAX_WHOLE_JSON_BYTES)."""
    from memtrain.files import results

    run = tmp_path / "run"
    run.mkdir()
    assert results.read_result(run) is None  # absent
    (run / "result.json").write_text('{"steps": 3}')
    assert results.read_result(run) == {"steps": 3}
    monkeypatch.setattr(results, "MAX_WHOLE_JSON_BYTES", 8)  # the file is 12 bytes
    assert results.read_result(run) is None
    monkeypatch.undo()
    for text in ("[1, 2]", "not json"):
        (run / "result.json").write_text(text)
        assert results.read_result(run) is None, text
    (run / "result.json").unlink()
    os.mkfifo(run / "result.json")  # opening it would block the reader
    assert results.read_result(run) is None
    (run / "result.json").unlink()
    (tmp_path / "elsewhere.json").write_text('{"steps": 3}')
    (run / "result.json").symlink_to(tmp_path / "elsewhere.json")
    assert results.read_result(run) is None


def _many_benches(folder: Path) -> list[dict]:
    """results.jsonl of benches appended to one folder: the 3 rows of tests/data under two settings
    ids in turn, 40 times, each row's numbers its own, with torn and wrong-shaped lines among them."""
    base = [json.loads(line) for line in (DATA / "bench_results.jsonl").read_text().splitlines()]
    rows = [{**row, "settings_hash": sid, "val_ppl": 100.0 + i, "row_wall_s": float(i)}
            for i in range(40) for sid in ("aa", "bb") for row in base]
    lines = [json.dumps(r) for r in rows]
    lines[7:7] = ['{"technique": "torn', '{"technique": 5, "status": "ok"}']
    (folder / "results.jsonl").write_text("\n".join(lines) + "\n")
    return rows


@pytest.mark.parametrize("settings", [None, "aa"])
def test_report_holds_the_latest_row_per_technique_and_settings_not_every_row(tmp_path, monkeypatch, settings):
    """`memtrain report` held every row of results.jsonl (30,000 rows: 470 MB) where it shows the
    latest of each technique: it streams them now and keeps 3 techniques x 2 settings of 240 rows,
    and writes the report the full read writes (tables, the other settings' line, the skipped count)."""
    import memtrain.commands.report as report_command  # patched here: the rows the command hands on
    from memtrain.files.bench_store import read_results_counted
    from memtrain.report import write_report

    _many_benches(tmp_path)
    held: list[int] = []
    real = report_command.write_report

    def counting(out, **kwargs):
        held.append(len(kwargs["read"].rows))
        return real(out, **kwargs)
    monkeypatch.setattr(report_command, "write_report", counting)
    assert main(["report", str(tmp_path), *(["--settings", settings] if settings else [])]) == 0
    assert held == [6]
    full = tmp_path / "full"
    full.mkdir()
    summary = write_report(full, read=read_results_counted(tmp_path), settings=settings, plots=False)
    assert summary["skipped_lines"] == 2 and summary["other_settings"]  # the other settings are named
    for name in ("report.json", "report.csv"):
        assert (tmp_path / name).read_text() == (full / name).read_text()
    assert (tmp_path / "report.md").read_text() == (full / "report.md").read_text().replace(str(full), str(tmp_path))
