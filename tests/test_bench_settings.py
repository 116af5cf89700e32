"""A bench row counts as done only under the settings it ran with, and a report never compares
rows run under different settings: `memtrain bench` resumes and `memtrain report` groups by
each row's ``settings_hash`` (the model, data and training settings every row of a bench
shares, the max-batch search, the device, the processes per row)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import memtrain.bench.device_rows as device_rows
import memtrain.bench.runner as runner
from conftest import TINY_MODEL, cli_flags
from memtrain.bench.runner import BenchOptions, bench_settings, run_bench, settings_hash
from memtrain.cli import main
from memtrain.files.bench_store import UNRECORDED_SETTINGS, append_result, read_results, row_settings
from memtrain.report import write_report

SHAPE = {**TINY_MODEL, "seq_len": 32, "val_blocks": 2, "device": "cpu", "progress": False}


def _fake_row(name: str, cfg: Any, opts: BenchOptions, eta: Any = None, known_max_batch: Any = None) -> dict:
    """What a finished row's process returns, without running it (the resume key and the report
    read only these parts): its Max Batch found when the bench asked for a search."""
    spec = runner._maxbatch_spec(opts, cfg)
    return {"status": "ok", "config": cfg.to_dict(), "val_ppl": 100.0, "val_loss": 4.6,
            "step_time_s": {"median": 0.1, "p10": 0.1, "p90": 0.1}, "tokens_per_s": 100.0,
            "memory": {"peak_bytes": 2**20, "by_category": {}}, "env": {"device": "cpu"},
            "max_batch": {"batch_size": 4, "budget_bytes": spec["budget_bytes"]} if spec else None}


@pytest.fixture
def fake_rows(monkeypatch):
    """Rows that finish at once: no subprocess, no device probe."""
    monkeypatch.setattr(runner, "run_row_subprocess", _fake_row)
    monkeypatch.setattr(device_rows, "runner_caps", lambda device, cfg=None: None)


def _opts(out: Path, **kw: Any) -> BenchOptions:
    overrides = {**SHAPE, "steps": 2, "batch_size": 2, **kw.pop("overrides", {})}
    return BenchOptions(**{"techniques": ["baseline"], "out": out, "overrides": overrides, "maxbatch": False,
                           "progress": False, "eta": False, **kw})


def _ran(opts: BenchOptions) -> list[bool]:
    """Which rows of ``opts`` ran (False: found done)."""
    seen: list[bool] = []
    run_bench(opts, on_row=lambda name, row: seen.append(not row.get("skipped")))
    return seen


def test_a_max_batch_search_asked_later_runs_the_row_again(fake_rows, tmp_path, capsys):
    """A row benched with --no-maxbatch was "already done" when the same bench asked for the
    search, and its Max Batch stayed n/a."""
    out = tmp_path / "b"
    assert _ran(_opts(out)) == [True]
    searched = _opts(out, maxbatch=True, memory_budget="100MiB", max_batch=16)
    capsys.readouterr()
    assert _ran(searched) == [True]
    assert "[baseline] settings changed since its earlier row (max-batch search); running it again" \
        in capsys.readouterr().err
    assert "| Baseline (FP32) | 4 |" in (out / "report.md").read_text()  # a CPU row: no TF32
    assert _ran(searched) == [False]  # the same settings again: done
    # Every search setting is part of the row's settings, and so are the processes per row.
    assert _ran(_opts(out, maxbatch=True, memory_budget="200MiB", max_batch=16)) == [True]
    assert _ran(_opts(out, maxbatch=True, memory_budget="200MiB", max_batch=8)) == [True]
    assert _ran(_opts(out, maxbatch=True, memory_budget="200MiB", max_batch=8, multiple_of=2)) == [True]
    assert _ran(_opts(out)) == [False]  # the first bench's row still counts for its settings
    rows = read_results(out)
    assert len(rows) == 5 and all(len(row_settings(r)) == 16 for r in rows)
    assert rows[1]["max_batch_search"] == {"budget_bytes": 100 * 2**20, "max_batch": 16, "multiple_of": 1}
    assert rows[0]["max_batch_search"] is None and rows[0]["nproc"] == 1
    assert settings_hash(bench_settings(_opts(out, nproc=2))) != settings_hash(bench_settings(_opts(out)))


def test_rows_benched_on_another_device_model_are_another_bench(fake_rows, tmp_path, monkeypatch, capsys):
    """A folder benched on one GPU (or CPU) model and then on another: the rows of the first
    counted as done on the second, and the report put both machines' step times in one table.
    The device's model is one of the bench's settings now, and the rerun says which changed."""
    out = tmp_path / "b"
    monkeypatch.setattr(runner, "hardware_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert _ran(_opts(out)) == [True]
    assert _ran(_opts(out)) == [False]
    first = read_results(out)[0]
    assert first["device_name"] == "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(runner, "hardware_name", lambda device: "NVIDIA H200")
    capsys.readouterr()
    assert _ran(_opts(out)) == [True]
    assert ("[baseline] settings changed since its earlier row (device: NVIDIA H100 80GB HBM3 then, NVIDIA H200 "
            "now); running it again") in capsys.readouterr().err
    second = read_results(out)[-1]
    assert row_settings(first) != row_settings(second)


def test_a_data_file_edited_in_place_runs_the_rows_again(fake_rows, tmp_path, capsys):
    """A bench's rows were done by the data's path: a data file rewritten between two benches
    kept the first one's perplexities in the second's report."""
    data = tmp_path / "posts.txt"
    data.write_text("how do I free GPU memory in torch\n" * 400)
    out = tmp_path / "b"
    assert _ran(_opts(out, overrides={"data": str(data)})) == [True]
    assert _ran(_opts(out, overrides={"data": str(data)})) == [False]
    data.write_text("why does my batch not fit on the card\n" * 400)
    capsys.readouterr()
    assert _ran(_opts(out, overrides={"data": str(data)})) == [True]
    assert "settings changed since its earlier row (the data's content)" in capsys.readouterr().err
    first, last = read_results(out)
    assert first["data_fingerprint"] != last["data_fingerprint"]


def test_the_device_name_is_the_cpu_model_on_a_cpu():
    import torch

    from memtrain.devices.probe import cpu_model

    assert runner.hardware_name(torch.device("cpu")) == cpu_model() != ""


def test_result_json_and_the_reports_name_the_cpu_model_beside_its_core_count():
    """A result's ``env.device`` gives a CPU's core count only; ``env.device_model`` names which CPU
    (a figure's hardware), and the reports show both."""
    import torch

    from memtrain.devices.probe import cpu_model
    from memtrain.report.labels import hardware_text
    from memtrain.runtime.env import environment

    env = environment(torch.device("cpu"))
    assert env["device_model"] == cpu_model() and env["device"].startswith("cpu (")
    assert hardware_text(env) == f"{cpu_model()}, {env['device']}"
    assert hardware_text({"device": "NVIDIA H200", "device_model": "NVIDIA H200"}) == "NVIDIA H200"
    assert hardware_text({"device": "synthetic"}) == "synthetic"  # written before device_model was recorded


def test_the_same_settings_spelled_otherwise_are_the_same(tmp_path):
    """The settings are what the rows run with, not how they were asked for."""
    plain = settings_hash(bench_settings(_opts(tmp_path, maxbatch=True, memory_budget="1GiB")))
    assert settings_hash(bench_settings(_opts(tmp_path, maxbatch=True, memory_budget=str(2**30)))) == plain
    # On a CPU the search's budget is 1 GiB unless the scale sets one (SCALE_BUDGET).
    assert settings_hash(bench_settings(_opts(tmp_path, maxbatch=True, scale="seed"))) == \
        settings_hash(bench_settings(_opts(tmp_path, maxbatch=True, scale="seed", memory_budget="1GiB")))
    # Which rows a bench lists is not one of its settings: a row added later joins the others.
    assert settings_hash(bench_settings(_opts(tmp_path, techniques=["baseline", "bf16"]))) == \
        settings_hash(bench_settings(_opts(tmp_path)))
    assert settings_hash(bench_settings(_opts(tmp_path, overrides={"steps": 3}))) != \
        settings_hash(bench_settings(_opts(tmp_path)))


def test_a_row_that_records_no_settings_runs_again(fake_rows, tmp_path, capsys):
    """Rows written before settings_hash existed are read (the report shows them) but never
    count as done: which search or budget they ran with is unknown."""
    out = tmp_path / "b"
    opts = _opts(out)
    (_, cfg), = runner.resolve_rows(opts)
    old = {**_fake_row("baseline", cfg, opts), "technique": "baseline", "config_hash": runner.config_hash(cfg.to_dict())}
    append_result(out, old)
    assert row_settings(read_results(out)[0]) == UNRECORDED_SETTINGS
    assert _ran(opts) == [True]
    assert "[baseline] its earlier row does not record its bench settings; running it again" in capsys.readouterr().err
    assert _ran(opts) == [False]
    assert len(read_results(out)) == 2


def test_a_bench_reports_its_own_rows_not_a_later_benchs(fake_rows, tmp_path, capsys):
    """A row found done under this bench's settings is the one its report and its return show,
    even when a later bench ran the same technique otherwise."""
    out = tmp_path / "b"
    first, second = _opts(out), _opts(out, overrides={"batch_size": 4})
    _ran(first), _ran(second)
    (row,) = run_bench(first)
    assert "skipped" not in row and row["config"]["train"]["batch_size"] == 2
    bench = ["bench", "--techniques", "baseline", "--out", str(out), "--no-maxbatch"]
    assert main([*bench, *cli_flags({**SHAPE, "steps": 2, "batch_size": 2})]) == 0
    assert "[baseline] already done" in capsys.readouterr().err
    assert "batch 2 x seq 32" in (out / "report.md").read_text()
    assert len(read_results(out)) == 2


def _two_benches(out: Path) -> tuple[str, str]:
    """B's folder: baseline and chunked-loss at batch 2 for 2 steps, then baseline alone at batch
    4 for 3 steps; the two settings ids."""
    assert main(["bench", "--techniques", "baseline,chunked-loss", "--out", str(out), "--no-maxbatch",
                 *cli_flags({**SHAPE, "steps": 2, "batch_size": 2})]) == 0
    assert main(["bench", "--techniques", "baseline", "--out", str(out), "--no-maxbatch",
                 *cli_flags({**SHAPE, "steps": 3, "batch_size": 4})]) == 0
    rows = read_results(out)
    return row_settings(rows[0]), row_settings(rows[-1])


def test_report_never_mixes_rows_of_different_settings(fake_rows, tmp_path, capsys):
    """`memtrain report` showed the second bench's header ("batch 4 x seq 32, 3 steps") over a
    chunked-loss row run at batch 2 for 2 steps, and recommended between them; the second
    bench's own report showed baseline alone."""
    out = tmp_path / "b"
    old, new = _two_benches(out)
    assert old != new
    bench_md = (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert md == bench_md  # `report DIR` agrees with what the bench wrote
    assert "batch 4 x seq 32, 3 steps" in md and "Chunked LM-head loss" not in md
    assert md.count("| Baseline (FP32) |") == 2  # the main table and the breakdown: one row
    assert (f"**Other settings**: results.jsonl also holds 2 rows run under other settings, not compared here: "
            f"settings `{old}` (baseline, chunked-loss). `memtrain report {out} --settings ID` reports those of "
            "settings ID.") in md
    report = json.loads((out / "report.json").read_text())
    assert report["settings"] == new and report["other_settings"] == [
        {"settings": old, "techniques": ["baseline", "chunked-loss"]}]
    assert [r["technique"] for r in report["rows"]] == ["baseline"]
    # The older rows, on request: their own header, and the newer row named instead.
    assert main(["report", str(out), "--settings", old]) == 0
    md = (out / "report.md").read_text()
    assert "batch 2 x seq 32, 2 steps" in md and "Chunked LM-head loss" in md
    assert f"settings `{new}` (baseline)" in md
    assert [r["batch_size"] for r in json.loads((out / "report.json").read_text())["rows"]] == [2, 2]


def test_report_of_unknown_settings_is_one_error_line(fake_rows, tmp_path, capsys):
    out = tmp_path / "b"
    old, new = _two_benches(out)
    before = (out / "report.md").read_text()
    capsys.readouterr()
    assert main(["report", str(out), "--settings", "0123"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --settings 0123: no row of {out}/results.jsonl ran under these settings; "
                   f"it holds {new}, {old}"]
    assert (out / "report.md").read_text() == before  # nothing rewritten


def test_rows_without_settings_are_one_group_and_their_report_is_unchanged(tmp_path):
    """A folder whose rows all predate settings_hash reports as it did (tests/data's golden
    report covers the text); beside newer rows they are the settings "unrecorded"."""
    data = Path(__file__).parent / "data" / "bench_results.jsonl"
    (tmp_path / "results.jsonl").write_text(data.read_text())
    summary = write_report(tmp_path, plots=False)
    assert summary["other_settings"] == [] and summary["settings"] == UNRECORDED_SETTINGS
    alone = (tmp_path / "report.md").read_text()
    assert "Other settings" not in alone and "settings" not in json.loads((tmp_path / "report.json").read_text())
    assert row_settings({"settings_hash": "\x1b[2J"}) == UNRECORDED_SETTINGS  # printed nowhere as given
    newer = {**read_results(tmp_path)[0], "settings_hash": "0" * 16}
    append_result(tmp_path, newer)
    summary = write_report(tmp_path, plots=False)
    assert summary["rows"] == 1 and summary["other_settings"][0][0] == UNRECORDED_SETTINGS
    assert write_report(tmp_path, plots=False, settings=UNRECORDED_SETTINGS)["rows"] == len(summary["other_settings"][0][1])
    assert (tmp_path / "report.md").read_text().replace(
        f"**Other settings**: results.jsonl also holds 1 row run under other settings, not compared here: settings "
        f"`{'0' * 16}` (baseline). `memtrain report {tmp_path} --settings ID` reports those of settings ID.\n\n", "") == alone
