"""`memtrain bench --model SPEC`: a bench row trains a transformers model; `--scale` names the
run scale (`--preset`, the interface contract's name, is the same flag)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")

from memtrain.cli import build_parser, main  # noqa: E402


def test_scale_flag():
    parser = build_parser()
    assert parser.parse_args(["bench", "--scale", "seed"]).scale == "seed"
    assert parser.parse_args(["bench", "--preset", "seed"]).scale == "seed"
    assert parser.parse_args(["bench"]).scale == "quick"


@pytest.mark.parametrize("flags, words", [
    (["--preset", "seed", "--scale", "quick"], "--preset seed and --scale quick name different scales"),
    (["--scale", "quick", "--preset", "seed"], "--scale quick and --preset seed name different scales"),
    (["--preset", "lowest-memory"], "use --techniques lowest-memory for the rows and --scale"),
    (["--preset", "huge"], "unknown scale 'huge' (--preset"),
])
def test_preset_is_the_scale_and_refuses_what_is_not_one(flags, words, tmp_path, capsys):
    """--preset quick|seed (design.md's contract) was refused as an unknown flag; it names the
    scale again, and neither silently loses to a different --scale nor takes a technique preset."""
    out = tmp_path / "b"
    assert main(["bench", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and words in err, err
    assert not out.exists()


def test_unknown_scale_is_a_clear_error(tmp_path, capsys):
    assert main(["bench", "--scale", "huge", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "unknown scale 'huge' (--scale)" in err


def test_bench_row_trains_a_transformers_model(llama_dir, small_corpus, tmp_path, capsys):
    """One row (each row is a fresh process: one keeps the test short): LoRA on the Llama."""
    out = tmp_path / "bench"
    code = main(["bench", "--model", str(llama_dir), "--scale", "quick", "--techniques",
                 "precision=fp32+attention=sdpa+lora_rank=4", "--data", str(small_corpus), "--batch-size", "2",
                 "--seq-len", "16", "--steps", "2", "--warmup-steps", "1", "--val-blocks", "2", "--no-maxbatch",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok"]
    # The row's line names no max batch where none was searched (not "max batch None").
    assert "] ok: val ppl" in err and "max batch" not in err
    row = rows[0]
    assert row["config"]["model"]["model"] == str(llama_dir)
    assert row["config"]["model"]["d_model"] == 16  # the shape mirrors the transformers config
    assert row["named_settings"] == ["attention", "lora_rank", "precision"]  # what its name sets, for the report
    assert row["memory"]["peak_bytes"] > 0 and len(row["loss_history"]) == 2
    # peft's adapters only: 2 x r x (in + out) per Linear of the one decoder layer
    assert 0 < row["trainable_parameters"] < row["parameters"]
    # AdamW state of the adapters only: two FP32 moments per element (+ a step scalar per tensor)
    assert 8 * row["trainable_parameters"] <= row["memory"]["by_category"]["optimizer"] < 8 * row["trainable_parameters"] + 512
    # The report names the model the rows trained (its Model line gave the shape only).
    assert f"Model: `{llama_dir}`, d_model 16" in (out / "report.md").read_text()


def test_a_bench_row_on_a_transformers_model_gets_the_attention_train_gets(llama_dir):
    """A row that names no attention runs what `train --model` runs (transformers' sdpa), not our
    GPT's math default; a row or preset that names one keeps it."""
    from memtrain.bench.runner import BenchOptions, resolve_rows
    from memtrain.cli import config_from_args

    opts = BenchOptions(techniques=["lora_rank=4", "attention=math", "baseline"], overrides={"model": str(llama_dir), "seq_len": 32})
    rows = dict(resolve_rows(opts))
    trained = config_from_args(build_parser().parse_args(["train", "--model", str(llama_dir), "--lora-rank", "4",
                                                          "--seq-len", "32"]))
    assert rows["lora_rank=4"].technique.attention == trained.technique.attention == "sdpa"
    assert rows["attention=math"].technique.attention == "math" and rows["baseline"].technique.attention == "math"
    gpt = dict(resolve_rows(BenchOptions(techniques=["lora_rank=4"])))
    assert gpt["lora_rank=4"].technique.attention == "math"  # our GPT keeps its default
