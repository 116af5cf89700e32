"""What keeps the default `memtrain bench` within minutes on 2 CPU cores: rows import only what
they use, the max-batch search confirms the analytic answer in two probes, and on a CPU the
default list's low-bit AdamW rows run Adafactor (no inductor compile), saying so; a row writes
its ETA heartbeat once, not at every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_MODEL
from memtrain.bench.device_rows import adapt_compiled_optims
from memtrain.bench.runner import BenchOptions, resolve_rows
from memtrain.bench.technique_sets import CUDA_DEFAULT_EXTRA, DEFAULT_TECHNIQUES, NOISE_ROWS, describe
from memtrain.cli import main
from memtrain.report.tables import markdown_report


def _imported_after(code: str) -> dict[str, bool]:
    """Which heavy packages a fresh interpreter has imported after running ``code``."""
    probe = (code + "\nimport json, sys\n"
             "print(json.dumps({m: m in sys.modules for m in ('torchao', 'transformers', 'datasets', "
             "'matplotlib', 'torch.distributed.checkpoint')}))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_worker_and_train_import_no_optional_heavy_packages():
    seen = _imported_after("import memtrain.bench.worker, memtrain.training.train")
    assert not any(seen.values()), seen


def test_a_traced_step_of_memtrains_model_does_not_import_transformers():
    # Each max-batch probe traces a step; importing transformers there cost about as long as
    # importing torch, per row.
    cfg = json.dumps({**TINY_MODEL, "vocab_size": 128, "seq_len": 16, "batch_size": 2, "device": "cpu"})
    seen = _imported_after(
        "from memtrain.config.run import build_config\nfrom memtrain.analysis.trace import trace_step\n"
        f"assert trace_step(build_config({cfg}))['peak_bytes'] > 0")
    assert not seen["transformers"] and not seen["torchao"], seen


def test_default_list_on_cpu_runs_adafactor_for_low_bit_adamw():
    rows = resolve_rows(BenchOptions(techniques=DEFAULT_TECHNIQUES + NOISE_ROWS))
    out, subs, notes = adapt_compiled_optims(rows, "cpu", substitute=True)
    assert set(subs) == {"lowest-memory"}
    assert subs["lowest-memory"]["from"] == "adamw-4bit" and subs["lowest-memory"]["to"] == "adafactor"
    before, after = dict(rows), dict(out)
    assert after["lowest-memory"].technique.optim == "adafactor"
    # Only the optimizer changes; every other row is untouched.
    assert after["lowest-memory"].replace(optim="adamw-4bit") == before["lowest-memory"]
    assert all(after[n] == before[n] for n in before if n != "lowest-memory")
    assert len(notes) == 1 and "lowest-memory" in notes[0] and "--techniques" in notes[0]
    # Named rows run as asked, and so does every row on CUDA.
    assert adapt_compiled_optims(rows, "cpu", substitute=False) == (rows, {}, [])
    assert adapt_compiled_optims(rows, "cuda", substitute=True) == (rows, {}, [])


def test_report_marks_the_optimizer_substitution():
    sub = {"from": "adamw-4bit", "to": "adafactor", "reason": "torchao compiles it"}
    rows = [{"technique": name, "description": describe(name), "status": "ok", "val_ppl": 1000.0,
             "config": {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "vocab_size": 50257},
                        "train": {"batch_size": 4, "seq_len": 32, "steps": 30, "lr": 1e-3, "warmup_steps": 3},
                        "data": {"data": "default"}, "technique": {"precision": "fp32"}},
             "memory": {"peak_bytes": 1, "by_category": {}}, "step_time_s": {"median": 0.1},
             "env": {"device": "cpu"}, **extra}
            for name, extra in (("baseline", {}), ("lowest-memory", {"substituted_optim": sub}),
                                ("baseline-nudge1", {}))]
    rows[1]["val_ppl"] = 900.0
    rows[2]["val_ppl"] = 1001.0  # a measured noise of 0.1% (twins equal to the digit would judge nothing)
    md = markdown_report(rows, [])
    assert "Lowest memory (ckpt + chunked + 4-bit AdamW) [ran Adafactor\u2020]" in md
    assert "\u2020 On this CPU, in this default list, 4-bit AdamW rows ran Adafactor (torchao compiles it)" in md
    assert "[ran Adafactor" not in md.split("Lowest memory")[0]  # the baseline row is unmarked
    # The quality table and the recommendation name the row the same way: Adafactor made that PPL.
    assert "| Lowest memory (ckpt + chunked + 4-bit AdamW) [ran Adafactor\u2020] | 900.00 | -10.00% |" in md
    assert "see the noise section): Lowest memory (ckpt + chunked + 4-bit AdamW) [ran Adafactor\u2020] (-10.00%)." in md


def test_bench_records_the_optimizer_substitution(small_corpus, tmp_path):
    """A real default-list row in its subprocess: Adafactor ran, the result and report say so."""
    from memtrain.bench.runner import run_bench

    overrides = {**TINY_MODEL, "data": str(small_corpus), "steps": 2, "warmup_steps": 1, "batch_size": 2,
                 "seq_len": 32, "val_blocks": 2, "precision": "fp32", "device": "cpu"}
    opts = BenchOptions(techniques=["lowest-memory"], out=tmp_path / "b", overrides=overrides,
                        maxbatch=False, progress=False, substitute_slow=True, eta=False)
    (row,) = run_bench(opts)
    assert row["status"] == "ok", row.get("error")
    assert row["config"]["technique"]["optim"] == "adafactor"
    assert row["substituted_optim"]["from"] == "adamw-4bit"
    assert "[ran Adafactor\u2020]" in (tmp_path / "b" / "report.md").read_text()
    # The runner rebuilt the tables after the row but left the plots to its caller (the CLI
    # draws them once, at the end or when interrupted).
    assert not list((tmp_path / "b").glob("*.png"))


def test_write_report_without_plots_writes_the_tables_only(tmp_path):
    from memtrain.files.bench_store import append_result
    from memtrain.report import write_report

    append_result(tmp_path, {"technique": "baseline", "status": "error", "error": "x"})
    summary = write_report(tmp_path, techniques=["baseline"], plots=False)
    assert summary["plots"] == [] and not list(tmp_path.glob("*.png"))
    assert all((tmp_path / f).is_file() for f in ("report.md", "report.csv", "report.json"))


def test_noise_row_reuses_its_twins_max_batch_search(small_corpus, tmp_path):
    """The traced search holds no values: a noise twin takes the baseline's answer, not a new trace."""
    from memtrain.bench.runner import run_bench, trace_key

    overrides = {**TINY_MODEL, "data": str(small_corpus), "steps": 2, "warmup_steps": 1, "batch_size": 2,
                 "seq_len": 32, "val_blocks": 2, "device": "cpu"}
    opts = BenchOptions(techniques=["baseline", NOISE_ROWS[0]], out=tmp_path / "b", overrides=overrides,
                        memory_budget="64MiB", max_batch=8, progress=False, eta=False)
    rows = dict(resolve_rows(opts))
    assert trace_key(rows["baseline"]) == trace_key(rows[NOISE_ROWS[0]]) == trace_key(rows["baseline"].replace(seed=9))
    assert trace_key(rows["baseline"]) != trace_key(rows["baseline"].replace(batch_size=3))
    first, second = run_bench(opts)
    assert first["status"] == second["status"] == "ok"
    assert "reused_from" not in first["max_batch"] and first["max_batch"]["batch_size"] >= 1
    assert second["max_batch"]["reused_from"] == "baseline"
    assert second["max_batch"]["batch_size"] == first["max_batch"]["batch_size"]
    assert second["max_batch"]["probes"] == first["max_batch"]["probes"]


def test_bench_help_shows_what_the_scales_run(capsys):
    """A flag a scale sets shows the scale's value as its default (the default scale first), not the
    config field's default that no bench row runs."""
    import re

    import pytest

    from memtrain.bench.scales import DEFAULT_SCALE, SCALES
    from memtrain.cli import main
    from memtrain.config.run import TrainConfig

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    quick, seed = SCALES[DEFAULT_SCALE], SCALES["seed"]
    for flag, key in (("--batch-size INT", "batch_size"), ("--seq-len INT", "seq_len"), ("--steps INT", "steps")):
        # Its help entry: after the usage line, up to the next option's entry.
        part = re.split(r" --[a-z][\w-]* [A-Z]+ ", text.rsplit(flag, 1)[1], maxsplit=1)[0]
        assert f"(default: the scale's: {DEFAULT_SCALE} {quick[key]}, seed {seed[key]})" in part, part
        assert f"(default: {getattr(TrainConfig(), key)})" not in part
    assert "==SUPPRESS==" not in text


def test_bench_help_quotes_no_train_default_that_a_scale_replaces(capsys):
    """No flag a scale sets says train's own default in its words: --steps said "one epoch is 200
    steps by default" and --warmup-steps "the default 200-step run warms up over all 200" while the
    default scale runs 40 steps with a 5-step warm-up."""
    import re
    from dataclasses import fields

    import pytest

    from memtrain.bench.scales import SCALES
    from memtrain.cli import main
    from memtrain.config.run import SECTIONS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    defaults = {f.name: f.default for cls in SECTIONS.values() for f in fields(cls)}
    keys = sorted({key for scale in SCALES.values() for key in scale})
    for key in keys:
        flag = "--" + key.replace("_", "-") + " "
        entry = re.split(r" --[a-z][\w-]* [A-Z]+ ", text.rsplit(flag, 1)[1], maxsplit=1)[0]
        words = entry.split("(default: the scale's:")[0]  # the help less the scale's defaults
        assert not re.search(rf"(?<![\d.]){re.escape(str(defaults[key]))}(?![\d.])", words), (key, words)
    steps = text.rsplit("--steps INT ", 1)[1]
    assert "by default" not in steps.split("--grad-accum")[0]


def test_the_quick_scale_shows_each_memory_technique_in_the_max_batch_column():
    """At the default scale and its CPU budget, the analytic estimator (which the traced search
    starts from and confirms) gives each memory-saving row of the default list a max batch
    several batches above the baseline's: flash attention and checkpointing, a share of the step's
    memory each, are more than the 1-2 batches a too-small budget would round them to."""
    from memtrain.analysis.estimate import estimate
    from memtrain.analysis.fit import largest_batch
    from memtrain.bench.scales import DEFAULT_SCALE, SCALE_BUDGET, SCALE_MAX_BATCH
    from memtrain.config.run import parse_size

    rows, _, _ = adapt_compiled_optims(resolve_rows(BenchOptions(techniques=list(DEFAULT_TECHNIQUES),
                                                                 scale=DEFAULT_SCALE)), "cpu", substitute=True)
    budget, cap = parse_size(SCALE_BUDGET[DEFAULT_SCALE]), SCALE_MAX_BATCH[DEFAULT_SCALE]
    best = {name: largest_batch(lambda c: estimate(c, device_type="cpu").peak_bytes, cfg, budget, 1, cap)
            for name, cfg in rows}
    base = best["baseline"]
    assert base is not None and base >= 20, best  # enough batches for a ~10% saving to show
    for name in ("flash-bf16", "ckpt-bf16"):
        assert best[name] >= base + 3 and best[name] >= 1.05 * base, (name, best)
    assert best["ckpt-bf16"] > best["flash-bf16"], best
    assert best["chunked-loss"] >= 10 * base, best
    assert best["chunked-loss"] < best["lowest-memory"] < cap, best  # a measured answer, not the search's cap


def test_a_bad_memory_budget_is_refused_before_any_warning_or_folder(tmp_path, capsys):
    """The budget was read only when the first row's max-batch search was set up: a warning about
    the default list came first, and the folder, its lock and rows/ were left behind."""
    from memtrain.cli import main

    out = tmp_path / "b"
    assert main(["bench", "--memory-budget", "lots", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "'lots'" in err, err
    assert not out.exists()


def test_a_row_writes_its_heartbeat_once_not_at_every_step(tmp_path, monkeypatch):
    """The ETA needs one heartbeat with a step time; an fsynced write at every step was host time
    in every step of every bench row."""
    import memtrain.bench.worker as worker
    import memtrain.training.train as train_module
    from memtrain.config.run import RunConfig

    writes: list[dict] = []
    real_write = worker.write_json_atomic

    def write(path, payload, *args):
        if Path(path).name == "hb.json":
            writes.append(payload)
        else:
            real_write(path, payload, *args)

    monkeypatch.setattr(worker, "write_json_atomic", write)

    def forty_steps(cfg, progress=None, on_step=None):
        for done in range(1, 41):
            on_step(done, 40, None if done <= 3 else 0.25)  # three steps of timing warm-up
        raise RuntimeError("stop after the steps")

    monkeypatch.setattr(train_module, "train", forty_steps)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"config": RunConfig().to_dict(), "heartbeat": str(tmp_path / "hb.json")}))
    assert worker.main([str(spec), str(out)]) == 0
    assert writes == [{"done": 4, "total": 40, "step_s": 0.25}]


def test_a_row_whose_cpu_allocation_failed_is_out_of_memory(tmp_path, monkeypatch):
    """The CPU allocator's failure ("can't allocate memory") made the row's status "error"; it is "oom"."""
    import memtrain.bench.worker as worker
    import memtrain.training.train as train_module
    from memtrain.config.run import RunConfig

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 6587285504 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(train_module, "train", no_memory)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"config": RunConfig().to_dict()}))
    assert worker.main([str(spec), str(out)]) == 0
    assert json.loads(out.read_text())["status"] == "oom"


@pytest.mark.parametrize("exc,oom", [
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"), True),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
    (MemoryError(), True),
    (ValueError("Out of memory while packing"), True),  # any error that says so, as the bench workers read it
    (RuntimeError("shape mismatch"), False),
])
def test_one_reading_of_an_out_of_memory_error_serves_every_worker(exc, oom):
    """memtrain's and the HF comparison's bench workers and train's one-line refusal read an
    out-of-memory error by one rule (memtrain.errors.is_out_of_memory)."""
    from memtrain.errors import is_out_of_memory

    assert is_out_of_memory(exc) is oom


def test_bench_help_names_every_row_the_default_list_adds_on_cuda(capsys):
    """--techniques' help lists the CUDA default list's extra rows (it said only compile)."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert f"(on CUDA {', '.join(CUDA_DEFAULT_EXTRA)} too" in text.replace("- ", "-"), text


def test_bench_help_of_stop_after_names_no_flag_bench_lacks(capsys):
    """train's help of --stop-after speaks of --save and --resume, which bench does not take."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    stop_after = text[text.index("--stop-after INT Stop"):text.index("--progress, --no-progress")]
    assert "Stop each row" in stop_after and "--save" not in stop_after and "--resume" not in stop_after


@pytest.mark.parametrize("content", ["", "  \n\n", '{"text": "a"\n'])
def test_data_without_a_document_is_refused_before_any_row_or_folder(tmp_path, capsys, content):
    """Each row found the empty (or broken) data alone: the bench wrote a report of failed rows
    and exited 1, where train says one error: line (exit 2) and writes nothing."""
    from memtrain.cli import main

    data = tmp_path / ("d.jsonl" if content.startswith("{") else "d.txt")
    data.write_text(content)
    out = tmp_path / "b"
    assert main(["bench", "--techniques", "baseline", "--no-maxbatch", "--data", str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "d." in err, err
    assert not out.exists()


def test_chat_records_pass_the_benchs_data_check_and_our_gpt_is_told_why_not(tmp_path):
    """The bench read a chat file's first record without the model's template, as text: every
    --data-format chat bench was refused with "field 'text' not found" (naming the very
    --data-format given). The check renders records as the rows do; our GPT, without a template,
    gets train's line about it."""
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    from memtrain.bench.runner import check_rows_data
    from memtrain.config.run import ConfigError, build_config
    from test_chat_data import CHATML, CONVERSATIONS, _chat_folder, _records

    folder = _chat_folder(tmp_path / "model", CHATML)
    data = _records(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS[:4]])
    chat = {"data": str(data), "data_format": "chat", "loss_on": "completion"}
    check_rows_data([("baseline", build_config({**chat, "model": str(folder), "seq_len": 32}))])
    with pytest.raises(ConfigError, match="chat template"):
        check_rows_data([("baseline", build_config({**chat, **TINY_MODEL}))])


def test_answers_only_over_text_data_is_refused_before_any_row_or_folder(tmp_path, capsys):
    """--loss-on completion over --data-format text: train's one error: line (the config no longer
    refuses it, so that estimate, plan and maxbatch can size such a step without data)."""
    from memtrain.cli import main

    data = tmp_path / "d.txt"
    data.write_text("some text\n")
    out = tmp_path / "b"
    assert main(["bench", "--techniques", "baseline", "--no-maxbatch", "--data", str(data), "--loss-on", "completion",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --loss-on completion") and err.count("\n") == 1, err
    assert not out.exists()
