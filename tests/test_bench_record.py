"""The bench record (OUT/bench_record.json): what each bench was asked to run, written before its
first row, so that `memtrain report` names the rows of a bench interrupted before it appended any;
a record that is corrupt, truncated or hostile is refused with one warning and the report built."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import memtrain.bench.runner as runner
from conftest import TINY_MODEL
from memtrain.bench.runner import BenchOptions, read_results, run_bench
from memtrain.bench.technique_sets import describe
from memtrain.cli import main
from memtrain.files import bench_record
from memtrain.files.bench_record import (
    MAX_RECORD_BYTES,
    MAX_RECORDS,
    new_record,
    read_bench_records,
    record_bench,
)
from memtrain.report import write_report

DATA = Path(__file__).parent / "data"
SID = "abc123"  # the settings id of the rows of `_folder`


def _finished_row() -> dict:
    return json.loads((DATA / "bench_results.jsonl").read_text().splitlines()[0])  # an ok baseline row


def _patch_rows(monkeypatch, interrupt: tuple[str, ...] = (), seen: list | None = None) -> None:
    """Rows that finish at once (the committed ok baseline row), and Ctrl-C (or SIGTERM, raised as
    KeyboardInterrupt) in each row named in ``interrupt``; ``seen``: gets what the record held
    when each row started."""

    def row(name, cfg, opts, eta=None, known_max_batch=None):
        if seen is not None:
            seen.append((name, read_bench_records(opts.out).benches))
        if name in interrupt:
            raise KeyboardInterrupt
        return _finished_row()

    monkeypatch.setattr(runner, "run_row_subprocess", row)


def _opts(out: Path, corpus: Path, techniques: list[str]) -> BenchOptions:
    return BenchOptions(techniques=techniques, out=out, maxbatch=False, progress=False, eta=False,
                        overrides={**TINY_MODEL, "data": str(corpus), "device": "cpu"})


def test_report_names_the_rows_of_a_second_bench_interrupted_before_its_first_row(small_corpus, tmp_path, monkeypatch,
                                                                                   capsys):
    """A second bench on the folder found baseline done, then was interrupted in chunked-loss
    before it appended a row: nothing said what it was asked, and `memtrain report` claimed a
    complete report. Its record, written before its first row, names chunked-loss missing."""
    out = tmp_path / "b"
    _patch_rows(monkeypatch)
    run_bench(_opts(out, small_corpus, ["baseline"]))
    _patch_rows(monkeypatch, interrupt=("chunked-loss",))
    with pytest.raises(KeyboardInterrupt):
        run_bench(_opts(out, small_corpus, ["baseline", "chunked-loss"]))
    assert len(read_results(out)) == 1  # the second bench appended nothing
    capsys.readouterr()  # the benches' own lines
    assert main(["report", str(out)]) == 0
    captured = capsys.readouterr()
    partial = "**Partial**: 1 of 2 techniques have no result yet (chunked-loss)."
    assert partial in captured.out and partial in (out / "report.md").read_text()
    assert "warning" not in captured.err
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["missing"] == ["chunked-loss"]
    benches = read_bench_records(out).benches
    assert [b["techniques"] for b in benches] == [["baseline"], ["baseline", "chunked-loss"]]
    assert {b["settings_hash"] for b in benches} == {read_results(out)[0]["settings_hash"]}


def test_the_record_is_written_before_the_first_row_runs(small_corpus, tmp_path, monkeypatch):
    out = tmp_path / "b"
    seen: list = []
    _patch_rows(monkeypatch, seen=seen)
    run_bench(_opts(out, small_corpus, ["baseline", "bf16"]))
    first_name, record_then = seen[0]
    assert first_name == "baseline" and [b["techniques"] for b in record_then] == [["baseline", "bf16"]]
    entry = record_then[0]
    assert entry["started"].endswith("+00:00") and entry["command"] == ""  # run_bench given no command line


def test_the_cli_records_its_command_line(small_corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "b"
    _patch_rows(monkeypatch)
    flags = ["--techniques", "baseline", "--out", str(out), "--no-maxbatch", "--steps", "1", "--no-progress",
             "--data", str(small_corpus), "--device", "cpu", "--d-model", "32", "--n-heads", "4", "--n-layers", "2",
             "--d-ff", "64", "--max-seq-len", "64"]
    assert main(["bench", *flags]) == 0
    capsys.readouterr()
    (entry,) = read_bench_records(out).benches
    assert entry["command"].startswith("memtrain bench --techniques baseline --out ") and entry["techniques"] == ["baseline"]


def _folder(tmp_path: Path) -> Path:
    """A bench folder of one ok baseline row run under settings SID, its bench's list [baseline]."""
    row = {**_finished_row(), "settings_hash": SID, "bench_techniques": ["baseline"]}
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    return tmp_path


def _record_text(*benches: dict) -> str:
    return json.dumps({"version": 1, "benches": list(benches)})


def _bench(techniques: list[str], sid: str = SID) -> dict:
    return {"techniques": techniques, "settings_hash": sid, "command": "memtrain bench", "started": "2026-12-01T00:00:00+00:00"}


def test_recorded_benches_under_the_reported_settings_name_their_missing_rows(tmp_path):
    out = _folder(tmp_path)
    assert write_report(out, plots=False)["missing"] == []  # no record: the rows' own lists, as before
    (out / "bench_record.json").write_text(_record_text(_bench(["baseline", "bf16"]), _bench(["lora"], sid="ffff"),
                                                        _bench(["ckpt-bf16", "bf16"])))
    summary = write_report(out, plots=False)
    # Benches of other settings are not this report's: their rows are another table.
    assert summary["missing"] == ["bf16", "ckpt-bf16"] and summary["record_problem"] is None


def test_a_recorded_bench_whose_settings_have_no_row_is_named_in_one_line(tmp_path, capsys):
    """A bench run under other settings (here, ffff00) and interrupted before its first row left
    rows of none of its settings: the report of the folder's other rows said nothing of it. One
    line names it (settings, planned rows, start, command line) in report.md, and report.json
    lists it; benches whose settings have rows are not named."""
    out = _folder(tmp_path / "b")
    newer = {**_bench(["baseline", "bf16"], sid="ffff00"), "command": "memtrain bench --steps 5"}
    (out / "bench_record.json").write_text(_record_text(_bench(["baseline"]), _bench(["lora"], sid="ffff00"), newer))
    assert main(["report", str(out)]) == 0
    captured = capsys.readouterr()
    line = ("**Not run**: bench_record.json names 1 bench that appended no row to results.jsonl (interrupted "
            "before its first row finished): settings `ffff00` (lora, baseline, bf16), started "
            "2026-12-01T00:00:00+00:00, `memtrain bench --steps 5`. Run it again to report its rows.")
    assert line in captured.out and line in (out / "report.md").read_text()
    assert captured.err == ""
    report = json.loads((out / "report.json").read_text())
    assert report["unrun_benches"] == [{"settings": "ffff00", "techniques": ["lora", "baseline", "bf16"],
                                        "started": "2026-12-01T00:00:00+00:00", "command": "memtrain bench --steps 5"}]
    assert report["missing"] == [] and [r["technique"] for r in report["rows"]] == ["baseline"]
    (out / "bench_record.json").write_text(_record_text(_bench(["baseline", "bf16"])))
    assert main(["report", str(out)]) == 0
    assert "Not run" not in capsys.readouterr().out
    assert "unrun_benches" not in json.loads((out / "report.json").read_text())


def test_several_unrun_benches_are_one_bounded_line(tmp_path):
    out = _folder(tmp_path / "b")
    (out / "bench_record.json").write_text(_record_text(*(_bench([f"t{i}"], sid=f"{i:04x}") for i in range(5))))
    summary = write_report(out, plots=False)
    assert [u.settings for u in summary["unrun_benches"]] == ["0004", "0003", "0002", "0001", "0000"]
    (line,) = [x for x in (out / "report.md").read_text().splitlines() if x.startswith("**Not run**")]
    assert "names 5 benches" in line and "; 2 more (report.json lists them)" in line and "`0001`" not in line
    assert len(json.loads((out / "report.json").read_text())["unrun_benches"]) == 5


@pytest.mark.parametrize("results", ["absent", "no rows"])
def test_a_folder_whose_only_bench_appended_no_row_says_so(tmp_path, capsys, results):
    """A first bench interrupted before its first row leaves bench_record.json and no row: the
    report said "not found; memtrain report takes a folder that memtrain bench wrote" (it is one)
    or "run memtrain bench first". Its one error line names the bench and says to run it again."""
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench_record.json").write_text(_record_text(_bench(["baseline", "bf16"])))
    if results == "no rows":
        (out / "results.jsonl").write_text("")
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    fact = f"{str(out / 'results.jsonl')!r} not found" if results == "absent" else f"{out}/results.jsonl holds no rows"
    assert err == (f"error: {fact}: bench_record.json names 1 bench that appended no row to results.jsonl (interrupted "
                   f"before its first row finished): settings {SID} (baseline, bf16), started 2026-12-01T00:00:00+00:00, "
                   "memtrain bench. Run it again to report its rows\n")
    (out / "bench_record.json").write_text(_record_text())  # nothing planned: the error as it was
    assert main(["report", str(out)]) == 2
    assert "memtrain bench" in capsys.readouterr().err.split(";", 1)[1]


def test_a_fifo_at_results_jsonl_is_said_as_it_was_whatever_the_record(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench_record.json").write_text(_record_text(_bench(["baseline"])))
    os.mkfifo(out / "results.jsonl")
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is a FIFO, not a file" in err and "bench_record.json" not in err


@pytest.mark.parametrize("record", [_record_text(), _record_text(_bench([]))], ids=["no bench", "an empty list"])
def test_a_record_that_plans_no_row_is_one_warning(tmp_path, capsys, record):
    """A record read whole that names no planned row (hand-edited: a bench records at least one)
    was taken in silence; it is said as an unreadable record is, and the report built."""
    out = _folder(tmp_path / "b")
    (out / "bench_record.json").write_text(record)
    assert main(["report", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [f"warning: {str(out / 'bench_record.json')!r} names no planned row (no bench, or only empty lists); "
                   "the rows' own lists name what is missing"]
    assert json.loads((out / "report.json").read_text())["missing"] == []


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _huge(path: Path) -> None:
    with path.open("wb") as f:  # sparse: its size refuses it, nothing is read
        f.truncate(MAX_RECORD_BYTES + 1)


def _outside_link(path: Path) -> None:
    target = path.parent.parent / "elsewhere.json"
    target.write_text(_record_text(_bench(["baseline", "evil"])))
    path.symlink_to(target)


def _inside_link(path: Path) -> None:
    (path.parent / "record-copy.json").write_text(_record_text(_bench(["baseline", "evil"])))
    path.symlink_to(path.parent / "record-copy.json")


HOSTILE = {
    "truncated": (lambda p: p.write_text(_record_text(_bench(["baseline", "evil"]))[:40]), "not JSON"),
    "not utf-8": (lambda p: p.write_bytes(b'{"version": 1, "benches": ["\xff"]}'), "not UTF-8"),
    "a list": (lambda p: p.write_text("[1, 2]"), '"benches" list'),
    "benches not a list": (lambda p: p.write_text('{"version": 1, "benches": "evil"}'), '"benches" list'),
    "another version": (lambda p: p.write_text('{"version": 99, "benches": []}'), "version is 99"),
    "deeply nested": (lambda p: p.write_text('{"version": 1, "benches": ' + "[" * 100_000 + "]" * 100_000 + "}"),
                      "not JSON"),
    "huge": (_huge, "more than a bench record holds"),
    "link outside": (_outside_link, "symbolic link"),
    "link inside": (_inside_link, "symbolic link"),  # a result.json's reader would follow it; this one reads no link
    "FIFO": (_fifo, "FIFO"),
    "a folder": (lambda p: p.mkdir(), "directory"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_bad_record_is_refused_with_one_warning_and_the_report_built(tmp_path, capsys, case):
    make, words = HOSTILE[case]
    out = _folder(tmp_path / "b")
    make(out / "bench_record.json")
    assert main(["report", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("warning: ") and "bench_record.json" in err[0] and words in err[0], err
    report = json.loads((out / "report.json").read_text())
    assert report["missing"] == [] and [r["technique"] for r in report["rows"]] == ["baseline"]


@pytest.mark.parametrize("entry, words", [
    ({"techniques": "baseline,evil", "settings_hash": SID, "command": "c", "started": "s"}, "list of at most"),
    ({"techniques": [1, 2], "settings_hash": SID, "command": "c", "started": "s"}, "list of at most"),
    ({"techniques": ["x" * 600], "settings_hash": SID, "command": "c", "started": "s"}, "at most 512 characters"),
    ({"techniques": ["evil"], "settings_hash": "../../x", "command": "c", "started": "s"}, "hex id"),
    ({"techniques": ["evil"], "settings_hash": SID, "command": 7, "started": "s"}, "must be text"),
    ("evil", "not an object"),
])
def test_entries_of_the_wrong_shape_are_left_out_and_the_others_read(tmp_path, capsys, entry, words):
    out = _folder(tmp_path / "b")
    (out / "bench_record.json").write_text(_record_text(entry, _bench(["baseline", "bf16"])))
    assert main(["report", str(out)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "1 entr(ies) of the wrong shape left out" in err[0] and words in err[0], err
    assert json.loads((out / "report.json").read_text())["missing"] == ["bf16"]


def test_record_bench_keeps_the_newest_and_replaces_a_corrupt_file(tmp_path):
    for i in range(MAX_RECORDS + 3):
        assert record_bench(tmp_path, new_record([f"t{i}"], SID, "memtrain bench")) is None
    benches = read_bench_records(tmp_path).benches
    assert len(benches) == MAX_RECORDS and benches[0]["techniques"] == ["t3"] and benches[-1]["techniques"] == [f"t{MAX_RECORDS + 2}"]
    (tmp_path / "bench_record.json").write_text('{"version": 1, "benches": [')  # torn by hand
    problem = record_bench(tmp_path, new_record(["baseline"], SID, "memtrain bench"))
    assert problem is not None and "not JSON" in problem and "\n" not in problem
    assert [b["techniques"] for b in read_bench_records(tmp_path).benches] == [["baseline"]]
    assert list(tmp_path.glob("*.tmp")) == []  # written through a temporary file and a rename


def test_record_bench_never_writes_a_file_its_reader_refuses(tmp_path, monkeypatch):
    """Long lists fill the file: the oldest benches go first; one list too long for a record is
    not recorded, and the file stays readable as it was."""
    monkeypatch.setattr(bench_record, "MAX_RECORD_BYTES", 2000)
    for i in range(20):
        assert record_bench(tmp_path, new_record([f"row-{i}-" + "x" * 100], SID, "memtrain bench")) is None
        assert (tmp_path / "bench_record.json").stat().st_size <= 2000
    kept = read_bench_records(tmp_path)
    assert kept.problem is None and 1 < len(kept.benches) < 20 and kept.benches[-1]["techniques"][0].startswith("row-19-")
    before = (tmp_path / "bench_record.json").read_bytes()
    problem = record_bench(tmp_path, new_record(["y" * 500] * 10, SID, "memtrain bench"))
    assert problem is not None and "not recorded" in problem
    assert (tmp_path / "bench_record.json").read_bytes() == before
    problem = record_bench(tmp_path, new_record([f"t{i}" for i in range(300)], SID, "memtrain bench"))
    assert problem is not None and "list of at most 256 names" in problem
    long_command = new_record(["baseline"], SID, "memtrain bench " + "x" * 10_000)["command"]
    assert len(long_command) == bench_record.MAX_TEXT_CHARS and long_command.endswith(" ...")


def test_a_bench_warns_once_and_runs_over_a_corrupt_record(small_corpus, tmp_path, monkeypatch, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "bench_record.json").write_text("not json at all")
    _patch_rows(monkeypatch)
    run_bench(_opts(out, small_corpus, ["baseline"]))
    err = [line for line in capsys.readouterr().err.splitlines() if "bench_record.json" in line]
    assert len(err) == 1 and err[0].startswith("warning: ") and "not JSON" in err[0]
    assert [b["techniques"] for b in read_bench_records(out).benches] == [["baseline"]]


def test_a_bench_refuses_a_link_at_its_record_before_any_row_runs(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    target = tmp_path / "elsewhere.json"
    target.write_text("keep me")
    (out / "bench_record.json").symlink_to(target)
    assert main(["bench", "--techniques", "baseline", "--out", str(out), "--no-maxbatch", "--steps", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "bench_record.json" in err
    assert target.read_text() == "keep me" and not (out / "results.jsonl").exists()


def test_the_baseline_is_labelled_by_its_device_and_keeps_its_name(small_corpus, tmp_path, monkeypatch):
    """TF32 is a CUDA mode: on a CPU the baseline's label said "Baseline (TF32/FP32)". Its label
    now names FP32 there; its name (which rows are matched by) is unchanged."""
    assert describe("baseline", "cpu") == "Baseline (FP32)"
    assert describe("baseline", "cuda") == describe("baseline") == "Baseline (TF32/FP32)"
    assert describe("baseline-seed2", "cpu") == "Baseline (FP32), seed + 1 (noise)"
    assert describe("bf16", "cpu") == describe("bf16", "cuda")
    out = tmp_path / "b"
    _patch_rows(monkeypatch)
    run_bench(_opts(out, small_corpus, ["baseline"]))
    (row,) = read_results(out)
    assert row["technique"] == "baseline" and row["description"] == "Baseline (FP32)"
    assert "| Baseline (FP32) |" in (out / "report.md").read_text()
