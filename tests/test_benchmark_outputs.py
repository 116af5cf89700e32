"""The table-writing scripts of benchmarks/ keep what earlier runs wrote: a file, a folder or a
link where their output goes is refused in one line (exit 2) before any row runs, bad arguments
too, and rows are written as they finish, so a late failure loses none before it. step_overhead.py
runs at toy size and names its commit and CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "benchmarks"))  # trace_speed imports hf_models_table by name
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def _refused(main, argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and words in err[-1], err  # argparse's usage, then the one error line


@pytest.fixture
def planted(tmp_path):
    """A victim file, a link to it, a file and an existing folder."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "link").symlink_to(victim)
    (tmp_path / "file.md").write_text("an earlier table\n")
    (tmp_path / "folder").mkdir()
    yield tmp_path
    assert victim.read_text() == "precious\n" and (tmp_path / "file.md").read_text() == "an earlier table\n"


@pytest.mark.parametrize("script", ["technique_memory", "compile_budget_memory"])
def test_the_single_file_tables_refuse_an_existing_file_a_folder_and_a_link(script, planted, capsys):
    main = _load(script).main
    for name, words in (("file.md", "already exists"), ("folder", "is a folder"), ("link", "is a symbolic link")):
        _refused(main, ["--out", str(planted / name)], words, capsys)
    _refused(main, ["--batch-size", "0"], "must be a positive integer", capsys)


def test_technique_memory_refuses_sizes_a_row_cannot_run_and_writes_each_row_as_it_finishes(tmp_path, monkeypatch,
                                                                                         capsys):
    module = _load("technique_memory")
    _refused(module.main, ["--batch-size", "1"], "halves the batch: give --batch-size 2 or more", capsys)
    _refused(module.main, ["--seq-len", "16"], "--window 32 is larger than --seq-len 16", capsys)
    calls = []

    def fake(cfg, batch):
        calls.append(batch)
        if len(calls) == 3:
            raise RuntimeError("out of memory")
        return {"peak_bytes": 2**20 * len(calls), "peak_phase": "backward",
                "by_category": dict.fromkeys(module.CATS, 0)}

    monkeypatch.setattr(module, "measure_step_memory", fake)
    out = tmp_path / "t.md"
    with pytest.raises(RuntimeError):
        module.main(["--out", str(out)])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "peak phase" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| baseline fp32, math attention", "| bf16 autocast"]


def test_context_table_refuses_unknown_rows_and_a_used_folder(tmp_path, capsys):
    main = _load("context_table").main
    _refused(main, ["--rows", "bogus", "--out", str(tmp_path / "o")], "--rows: unknown bogus", capsys)
    _refused(main, ["--gpus", "rtx9090", "--out", str(tmp_path / "o")], "--gpus: unknown rtx9090", capsys)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "context_table.json").write_text("{}")
    _refused(main, ["--out", str(tmp_path / "used")], "already holds context_table.json", capsys)
    assert (tmp_path / "used" / "context_table.json").read_text() == "{}"


def test_the_resumable_tables_skip_a_torn_line_and_never_write_through_a_link(tmp_path, planted, capsys):
    """hf_models_table and trace_speed continue a folder (rows already there are kept): a line
    torn by a kill is skipped instead of stopping every later run, and a link under a name they
    write is refused before any row is traced."""
    table = _load("hf_models_table")
    out = tmp_path / "out"
    out.mkdir()
    row = {"model": "llama-3-8b", "set": "lora", "flags": {}, "method": "extrapolated", "probe_layers": [2, 3],
           "peak_bytes": 2**30, "peak_phase": "backward", "by_category": dict.fromkeys(
               ("parameters", "gradients", "optimizer", "activations", "temporaries"), 0), "parameters": 1,
           "trace_seconds": 1.0, "trace_cpu_seconds": 1.0}
    (out / "hf_models_table.jsonl").write_text(json.dumps(row) + "\n" + '{"model": "x"')  # torn last line
    assert table.main(["--models", "llama-3-8b", "--sets", "lora", "--out", str(out)]) == 0  # nothing left to trace
    assert "| llama-3-8b | lora |" in (out / "hf_models_table.md").read_text()
    (out / "hf_models_table.md").unlink()
    (out / "hf_models_table.md").symlink_to(planted / "victim.txt")
    _refused(table.main, ["--models", "llama-3-8b", "--sets", "lora", "--out", str(out)], "symbolic link", capsys)
    _refused(table.main, ["--sets", "nope", "--out", str(out)], "--sets: unknown nope", capsys)
    speed = _load("trace_speed")
    _refused(speed.main, ["--label", "after", "--rows", "llama-3-8b", "--out", str(tmp_path / "s")],
             "give model:set pairs", capsys)
    _refused(speed.main, ["--label", "after", "--out", str(planted / "file.md")], "is a file", capsys)


def test_step_overhead_prints_each_loop_with_its_commit_and_cpu_and_refuses_a_bad_skip(monkeypatch, capsys):
    """A smoke run at toy size (the figures themselves are docs/performance.md's, not a test's)."""
    main = _load("step_overhead").main
    monkeypatch.setattr(sys, "argv", ["step_overhead.py", "--steps", "23", "--skip", "20", "--repeats", "1",
                                      "--no-hf", "--log-every", "5"])
    main()
    out = capsys.readouterr().out
    assert "commit:" in out and "CPU:" in out and "command: python benchmarks/step_overhead.py --steps 23" in out
    rows = [line for line in out.splitlines() if line.startswith("| GPT")]
    assert [r.split("|")[1].strip() for r in rows] == ["GPT, vocab 50257: plain PyTorch loop",
                                                       "GPT, vocab 50257: memtrain train"]
    assert all(float(r.split("|")[2]) > 0 for r in rows)
    monkeypatch.setattr(sys, "argv", ["step_overhead.py", "--steps", "20", "--skip", "20"])
    _refused(lambda argv: main(), [], "--skip 20 must be at least 1 and below --steps 20", capsys)


def test_step_overhead_help_gives_each_options_meaning_and_default(monkeypatch, capsys):
    """--steps and --repeats had neither: the docs' "steps 21-200, best of 5" are these defaults."""
    main = _load("step_overhead").main
    monkeypatch.setattr(sys, "argv", ["step_overhead.py", "--help"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    for option, default in (("--steps STEPS", 200), ("--skip SKIP", 20), ("--repeats REPEATS", 5),
                            ("--log-every LOG_EVERY", 1)):
        described = text.split(option)[-1].split(" --")[0]
        assert f"(default {default})" in described, (option, described)
