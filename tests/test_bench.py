"""`memtrain bench`, `memtrain report` and `memtrain maxbatch`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import TINY_MODEL
from memtrain.analysis.maxbatch import find_max_batch
from memtrain.bench.runner import BenchOptions, read_results, resolve_rows, run_bench
from memtrain.bench.technique_sets import DEFAULT_TECHNIQUES, TECHNIQUES, technique_overrides
from memtrain.cli import main
from memtrain.config.run import ConfigError, build_config
from memtrain.report import write_report

DATA = Path(__file__).parent / "data"
UPDATE_GOLDEN = False  # set True once to rewrite the golden report after an intended change


def test_report_from_synthetic_results_matches_golden(tmp_path):
    shutil.copy(DATA / "bench_results.jsonl", tmp_path / "results.jsonl")
    summary = write_report(tmp_path, techniques=["baseline", "chunked-loss", "compile", "lora"])
    text = (tmp_path / "report.md").read_text()
    golden = DATA / "bench_report.md"
    if UPDATE_GOLDEN:
        golden.write_text(text)
    assert text == golden.read_text()
    assert summary["missing"] == ["lora"] and "**Partial**" in text
    assert {Path(p).name for p in summary["plots"]} == {"peak_memory.png", "step_time.png", "max_batch.png",
                                                         "memory_vs_time.png"}
    for p in summary["plots"]:
        assert Path(p).stat().st_size > 10_000
    csv_lines = (tmp_path / "report.csv").read_text().splitlines()
    assert len(csv_lines) == 4 and csv_lines[0].startswith("technique,method,status")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["partial"] is True and report["rows"][1]["estimate_error"] == pytest.approx(10 / 300)


def test_report_command(tmp_path, capsys):
    shutil.copy(DATA / "bench_results.jsonl", tmp_path / "results.jsonl")
    assert main(["report", str(tmp_path)]) == 0
    assert "Chunked LM-head loss" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nothing")]) == 2
    assert "nothing' not found; memtrain report takes a folder that memtrain bench wrote" in capsys.readouterr().err


def test_report_of_an_interrupted_bench_names_its_unfinished_rows(small_corpus, tmp_path, monkeypatch, capsys):
    """`memtrain report` on the folder of a bench interrupted in its second row rewrote report.md
    without the bench's "**Partial**: 1 of 2 techniques ..." line: each row records its bench's
    list (bench_techniques), and the report names those with no row as the bench did."""
    import memtrain.bench.runner as runner

    finished = json.loads((DATA / "bench_results.jsonl").read_text().splitlines()[0])  # an ok baseline row

    def row(name, cfg, opts, eta=None, known_max_batch=None):
        if name == "chunked-loss":  # its folder made, then Ctrl-C (or SIGTERM) before its result
            runner.row_folder(opts.out, name).mkdir(parents=True)
            raise KeyboardInterrupt
        return dict(finished)

    monkeypatch.setattr(runner, "run_row_subprocess", row)
    out = tmp_path / "b"
    opts = BenchOptions(techniques=["baseline", "chunked-loss"], out=out, maxbatch=False, progress=False, eta=False,
                        overrides={**TINY_MODEL, "data": str(small_corpus), "device": "cpu"})
    with pytest.raises(KeyboardInterrupt):
        run_bench(opts)
    partial = "**Partial**: 1 of 2 techniques have no result yet (chunked-loss)."
    assert partial in (out / "report.md").read_text()  # the bench's own report
    assert read_results(out)[0]["bench_techniques"] == ["baseline", "chunked-loss"]
    assert main(["report", str(out)]) == 0
    assert partial in capsys.readouterr().out and partial in (out / "report.md").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["partial"] is True and report["missing"] == ["chunked-loss"]


def test_report_without_recorded_bench_lists_names_nothing_missing(tmp_path):
    """Rows written before the bench recorded its list (the synthetic ones) claim no missing row;
    a hand-edited list of the wrong shape is skipped like a torn line."""
    shutil.copy(DATA / "bench_results.jsonl", tmp_path / "results.jsonl")
    summary = write_report(tmp_path, plots=False)
    assert summary["missing"] == [] and "**Partial**" not in (tmp_path / "report.md").read_text()
    with (tmp_path / "results.jsonl").open("a") as f:
        f.write(json.dumps({"technique": "lora", "status": "error", "error": "x", "bench_techniques": "lora,x"}) + "\n")
    summary = write_report(tmp_path, plots=False)
    assert summary["skipped_lines"] == 1 and summary["missing"] == []


def test_presets_resolve_for_both_scales():
    for scale in ("quick", "seed"):
        rows = resolve_rows(BenchOptions(techniques=list(TECHNIQUES), scale=scale))
        assert [n for n, _ in rows] == list(TECHNIQUES)
        for _, cfg in rows:
            assert cfg.technique.window is None or cfg.technique.window <= cfg.train.seq_len
    assert set(DEFAULT_TECHNIQUES) <= set(TECHNIQUES)
    assert technique_overrides("precision=bf16+loss=chunked", "quick") == {"precision": "bf16", "loss": "chunked"}


@pytest.mark.parametrize("techniques, message", [
    (["nope"], "unknown technique 'nope'"),
    (["bf16", "bf16"], "listed twice"),
    (["precision=fp9"], "unknown --precision"),
])
def test_bad_technique_lists(techniques, message):
    with pytest.raises(ConfigError, match=message):
        resolve_rows(BenchOptions(techniques=techniques))


def test_a_config_file_cannot_change_a_presets_own_technique():
    # The row labelled "BF16 Mixed Precision" ran in FP32 with LoRA when --config said so.
    file_layer = {"technique": {"precision": "fp32"}}
    with pytest.raises(ConfigError, match="technique 'bf16' sets precision and --config sets it too"):
        resolve_rows(BenchOptions(techniques=["bf16"], file_layer=file_layer))
    # Keys the preset leaves alone still apply to its row, and an explicit row may be written instead.
    (_, row), = resolve_rows(BenchOptions(techniques=["bf16"], file_layer={"checkpointing": "full"}))
    assert (row.technique.precision, row.technique.checkpointing) == ("bf16", "full")
    with pytest.raises(ConfigError, match="drop one"):
        resolve_rows(BenchOptions(techniques=["precision=bf16"], file_layer=file_layer))


def test_a_warmup_longer_than_the_run_is_refused_as_train_refuses_it(tmp_path, capsys):
    out = tmp_path / "b"
    flags = ["--steps", "2", "--warmup-steps", "5", "--no-maxbatch", "--techniques", "baseline", "--out", str(out)]
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--warmup-steps 5 is longer than --steps 2" in err
    assert not out.exists()
    # A warm-up named in a --config file or by the Trainer's ratio is the user's too.
    with pytest.raises(ConfigError, match="--warmup-steps 9 is longer than --steps 3"):
        resolve_rows(BenchOptions(techniques=["baseline"], file_layer={"train": {"steps": 3, "warmup_steps": 9}}))
    (_, row), = resolve_rows(BenchOptions(techniques=["baseline"], overrides={"steps": 4, "warmup_ratio": 0.5}))
    assert row.train.warmup_steps == 2


@pytest.mark.parametrize("scale, steps, warmup", [
    ("quick", 2, 1), ("quick", 3, 1), ("quick", 5, 5), ("quick", 100, 5), ("seed", 100, 10), ("seed", 300, 200),
])
def test_a_scales_warmup_fits_the_asked_steps(scale, steps, warmup):
    # The quick scale's 5 warm-up steps under --steps 2 left every row short of --lr; a scale's
    # warm-up that fits is kept, one that does not follows train's default (10% of the steps).
    (_, row), = resolve_rows(BenchOptions(techniques=["baseline"], scale=scale, overrides={"steps": steps}))
    assert row.train.warmup_steps == warmup <= row.train.steps
    (_, row), = resolve_rows(BenchOptions(techniques=["baseline"], scale=scale, file_layer={"train": {"steps": steps}}))
    assert row.train.warmup_steps == warmup
    # As the command line hands it over: text, converted by build_config.
    (_, row), = resolve_rows(BenchOptions(techniques=["baseline"], scale=scale, overrides={"steps": str(steps)}))
    assert row.train.warmup_steps == warmup


def test_a_scale_fitted_to_the_steps_reads_each_layer_once(monkeypatch):
    # The warm-up test and the --steps lookup read the same layers: their aliases are normalized
    # once per layer, not once for each question (the Trainer's max_steps is --steps).
    from memtrain.bench import scales
    from memtrain.config import layers

    calls = []
    normalize = layers.normalize_aliases

    def counting(flat):
        calls.append(dict(flat))
        return normalize(flat)

    monkeypatch.setattr(layers, "normalize_aliases", counting)
    layers = ({"steps": 50}, {"max_steps": 3}, {"lr": 1e-3})
    assert scales.fitted_scale_overrides("quick", *layers)["warmup_steps"] == 1
    assert len(calls) == len(layers)
    calls.clear()
    assert scales.fitted_scale_overrides("quick", {"max_steps": 3}, {"warmup_ratio": 0.5})["warmup_steps"] == 5
    assert len(calls) == 2


def _count_reads_outside_build_config(monkeypatch, module) -> list[dict]:
    """The layers whose aliases ``module`` normalizes itself (build_config's own reads not counted)."""
    from memtrain.config import layers

    calls: list[dict] = []
    inside = []
    normalize, build = layers.normalize_aliases, module.build_config

    def counting(flat):
        if not inside:
            calls.append(dict(flat))
        return normalize(flat)

    def building(*layers):
        inside.append(True)
        try:
            return build(*layers)
        finally:
            inside.pop()

    monkeypatch.setattr(layers, "normalize_aliases", counting)
    monkeypatch.setattr(module, "build_config", building)
    return calls


def test_a_bench_row_reads_each_given_layer_once(monkeypatch):
    # The scale's warm-up, the model's default attention and the refusal of a long warm-up ask the
    # same layers (the row's, --config's, the flags'): their aliases are normalized once per row.
    from memtrain.bench import runner

    calls = _count_reads_outside_build_config(monkeypatch, runner)
    opts = BenchOptions(techniques=["baseline", "bf16"], file_layer={"train": {"max_steps": 3}},
                        overrides={**TINY_MODEL, "seq_len": 32, "progress": False})
    rows = resolve_rows(opts)
    assert [cfg.train.warmup_steps for _, cfg in rows] == [1, 1]  # fitted to the Trainer's max_steps
    assert len(calls) == 3 * len(rows)


def test_every_scale_layer_is_flat_and_in_memtrains_names():
    # resolve_rows hands the scale's layer to attention_default_of as it is, unread.
    from memtrain.bench.scales import SCALES
    from memtrain.config.layers import normalized_layers

    for scale, layer in SCALES.items():
        assert normalized_layers(layer) == [layer], scale


def test_a_compare_hf_row_reads_each_given_layer_once(monkeypatch):
    from memtrain.bench.hf import rows as hf_rows

    calls = _count_reads_outside_build_config(monkeypatch, hf_rows)
    rows = hf_rows.resolve_rows("quick", ["baseline"], {"progress": False, "max_steps": 3}, "cpu")
    assert rows[0]["config"].train.warmup_steps == 1
    assert len(calls) == 2  # the preset's layer and the --set overrides


def test_bench_rows_resume_and_failures(small_corpus, tmp_path):
    """Two real rows in subprocesses, one that cannot run; rerun skips what finished."""
    overrides = {**TINY_MODEL, "data": str(small_corpus), "steps": 3, "warmup_steps": 1, "batch_size": 2,
                 "seq_len": 32, "val_blocks": 2}
    opts = BenchOptions(techniques=["baseline", "precision=bf16", "attention=flex"], out=tmp_path / "b",
                        overrides=overrides, maxbatch=False, progress=False)
    rows = run_bench(opts)
    status = {r["technique"]: r["status"] for r in rows}
    assert status == {"baseline": "ok", "precision=bf16": "ok", "attention=flex": "invalid"}
    assert "flex" in rows[2]["error"]
    lines = (tmp_path / "b" / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert (tmp_path / "b" / "report.md").is_file()
    # Resume: the ok rows are skipped, the failed one is tried again.
    seen = []
    run_bench(opts, on_row=lambda name, row: seen.append((name, bool(row.get("skipped")))))
    assert seen == [("baseline", True), ("precision=bf16", True), ("attention=flex", False)]
    assert len(read_results(tmp_path / "b")) == 4
    # --force reruns everything.
    run_bench(BenchOptions(**{**opts.__dict__, "techniques": ["baseline"], "force": True}))
    assert len(read_results(tmp_path / "b")) == 5


def test_bench_row_timeout_is_recorded(small_corpus, tmp_path):
    opts = BenchOptions(techniques=["baseline"], out=tmp_path / "t", maxbatch=False, progress=False,
                        overrides={**TINY_MODEL, "data": str(small_corpus), "steps": 3, "seq_len": 32},
                        timeout_s=0.5)
    rows = run_bench(opts)
    assert rows[0]["status"] == "timeout"


def test_maxbatch_search_with_synthetic_probe():
    """Grow then bisect: with a linear memory model the answer is exact and probes are few."""
    cfg = build_config({**TINY_MODEL, "seq_len": 32})
    probe = lambda c, b: 1000 + 100 * b  # noqa: E731
    res = find_max_batch(cfg, budget_bytes=1000 + 100 * 37, probe=probe, progress=False)
    assert res.batch_size == 37 and res.peak_bytes == 1000 + 3700
    assert len(res.probes) <= 12
    res8 = find_max_batch(cfg, budget_bytes=1000 + 100 * 37, probe=probe, multiple_of=8, progress=False)
    assert res8.batch_size == 32
    capped = find_max_batch(cfg, budget_bytes=10**9, probe=probe, max_batch=20, progress=False)
    assert capped.batch_size == 20
    with pytest.raises(ConfigError, match="even batch 1 does not fit"):
        find_max_batch(cfg, budget_bytes=500, probe=probe, progress=False)
    with pytest.raises(ConfigError, match="needs a budget"):
        find_max_batch(cfg, progress=False)


@pytest.mark.parametrize("method", ["trace"])
def test_maxbatch_checkpointing_fits_larger_batch(method):
    """Training steps under the tracked meter (traced with fake tensors: the same meter and
    code path as a real step, without the compute): full checkpointing frees activations, so
    a larger batch fits the same budget."""
    base = {**TINY_MODEL, "vocab_size": 256, "n_layers": 4, "seq_len": 64, "loss": "chunked"}
    budget = 24 * 2**20
    plain = find_max_batch(build_config(base), budget_bytes=budget, max_batch=256, progress=False, method=method)
    ckpt = find_max_batch(build_config({**base, "checkpointing": "full"}), budget_bytes=budget, max_batch=256,
                          progress=False, method=method)
    assert plain.peak_bytes <= budget and ckpt.peak_bytes <= budget
    assert ckpt.batch_size > plain.batch_size
    assert plain.method == method


def test_traced_probe_equals_measured_step():
    """The fast probe (fake tensors) gives the real step's tracked peak, to the byte."""
    from memtrain.analysis.maxbatch import measured_step_peak, traced_step_peak

    cfg = build_config({**TINY_MODEL, "vocab_size": 256, "seq_len": 32, "checkpointing": "full"})
    assert traced_step_peak(cfg, 3) == measured_step_peak(cfg, 3)


def test_maxbatch_cli_json(capsys):
    code = main(["maxbatch", "--json", "--memory-budget", "16MiB", "--method", "measure", "--max", "8",
                 "--d-model", "32", "--n-heads", "4", "--n-layers", "1", "--d-ff", "64", "--vocab-size", "256",
                 "--max-seq-len", "64", "--seq-len", "32"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and {"batch_size", "peak_bytes", "budget_bytes"} <= out.keys()
    assert out["budget_bytes"] == 16 * 2**20 and out["peak_bytes"] <= out["budget_bytes"]


def test_scatter_labels_do_not_overlap():
    """Crowded points (as the recorded quick bench's five ~0.5 GiB / ~0.38 s rows) get labels
    that overlap neither one another nor a marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    from memtrain.report.plots import place_labels

    points = [(0.508, 0.470), (0.528, 0.385), (0.516, 0.384), (0.518, 0.395), (0.495, 0.379),
              (0.350, 0.375), (0.233, 0.853)]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter(*zip(*points), s=60)
    ax.set_xlim(0, 0.66)
    ax.set_ylim(0, 1.07)
    labels = [f"technique-{i}\nppl 11084" for i in range(len(points))]
    anns = place_labels(ax, points, labels)
    renderer = fig.canvas.get_renderer()
    boxes = [Text.get_window_extent(a, renderer) for a in anns]
    r = 6 * fig.dpi / 72
    markers = [Bbox.from_extents(x - r, y - r, x + r, y + r) for x, y in ax.transData.transform(points)]
    for i, b in enumerate(boxes):
        assert not any(b.overlaps(o) for j, o in enumerate(boxes) if j != i), labels[i]
        assert not any(b.overlaps(m) for m in markers), labels[i]
    plt.close(fig)


@pytest.mark.parametrize("row, words", [("precision=bf16+precision=fp32", "sets precision twice; keep one"),
                                        ("lora-rank=2+lora_rank=4", "sets lora_rank twice; keep one"),
                                        ("out=/tmp/elsewhere", "sets out, which the bench sets for each row")])
def test_an_explicit_row_whose_key_could_only_be_ignored_is_refused_before_any_row_runs(tmp_path, capsys, row, words):
    """`precision=bf16+precision=fp32` ran as fp32 under its label, `out=DIR` ran in OUT/rows like
    any row: each silently ignored a setting the user wrote. Refused before anything runs."""
    out = tmp_path / "b"
    assert main(["bench", "--techniques", f"baseline,{row}", "--out", str(out), "--no-maxbatch", "--steps", "1",
                 "--no-progress"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], lines
    assert not (out / "results.jsonl").exists()
