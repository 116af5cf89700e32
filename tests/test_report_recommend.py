"""The bench report marks capped max batches, explains zero categories and recommends."""

from __future__ import annotations

import math

from memtrain.report.tables import markdown_report, table_rows

CATS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def _row(tech, step, peak, loss, precision="bf16", optim="adamw", window=None, probes=(True, False, True),
         mb=10, temporaries=5.0, phase="backward"):
    by = {"parameters": 1.0, "gradients": 0, "optimizer": 2.0, "activations": 3.0, "temporaries": temporaries}
    return {
        "technique": tech, "description": tech, "status": "ok",
        "config": {"train": {"batch_size": 4, "seq_len": 8, "steps": 2, "lr": 1e-3, "warmup_steps": 1},
                   "model": {"d_model": 8, "n_layers": 1, "n_heads": 1, "d_ff": 8, "vocab_size": 10, "vocab_multiple": 1},
                   "technique": {"precision": precision, "optim": optim, "window": window, "lora_rank": 0},
                   "data": {"data": "default"}},
        "memory": {"peak_bytes": peak, "by_category": {c: by[c] * 2**20 for c in CATS}, "peak_phase": phase},
        "step_time_s": {"median": step, "p10": step, "p90": step}, "total_time_s": 1.0, "tokens_per_s": 1.0,
        "val_loss": loss, "val_ppl": math.exp(loss),
        "max_batch": {"batch_size": mb, "budget_bytes": 2**30,
                      "probes": [{"batch_size": i + 1, "fits": f} for i, f in enumerate(probes)]},
    }


ROWS = [
    _row("baseline", 0.50, 0.5 * 2**30, 9.3130, precision="tf32"),
    _row("bf16", 0.40, 0.52 * 2**30, 9.3131),
    _row("flash-bf16", 0.38, 0.51 * 2**30, 9.3132),
    _row("chunked", 0.37, 0.35 * 2**30, 9.3131, temporaries=0, phase="forward"),
    _row("ckpt-chunked", 0.40, 0.25 * 2**30, 9.3130),
    _row("window", 0.36, 1.5 * 2**30, 9.3050, window=4),
    _row("4bit", 0.80, 0.20 * 2**30, 9.3700, optim="adamw-4bit", probes=(True, True, True), mb=256),
]


def test_capped_max_batch_is_a_lower_bound():
    recs = {r["technique"]: r for r in table_rows(ROWS)}
    assert recs["4bit"]["max_batch_capped"] and not recs["bf16"]["max_batch_capped"]
    md = markdown_report(ROWS, [])
    assert "| 4bit | 256+ |" in md and "| bf16 | 10 |" in md and "at least N" in md


def test_zero_categories_hidden_or_explained():
    md = markdown_report(ROWS, [])
    breakdown = md.split("## Memory at the peak, by category")[1].split("## Recommendation")[0]
    assert "Gradients (MiB)" not in breakdown and "Gradients column hidden: zero at the peak in every row" in breakdown
    assert "Temporaries (MiB)" in breakdown and "Temporaries 0.0 in chunked (peak in forward)" in breakdown
    assert "| Peak phase |" in breakdown


def test_recommendation_fastest_fitting_smallest_near_and_ppl_noise():
    md = markdown_report(ROWS, [])
    rec = md.split("## Recommendation")[1]
    # window is fastest but needs 1.5 GiB > the 1 GiB budget
    assert "Fastest row that fits 1.00 GiB (tracked peak): **chunked**" in rec
    # within 10% of 0.37 s: chunked, flash-bf16 (0.38), bf16 and ckpt-chunked (0.40) -> ckpt-chunked is smallest
    assert "Smallest memory within 10% of that step time: **ckpt-chunked**" in rec
    line = next(ln for ln in rec.splitlines() if "beyond noise" in ln)
    assert "window" in line and "4bit" in line
    for same in ("bf16 (", "flash-bf16", "chunked (", "ckpt-chunked ("):
        assert same not in line.split(":", 1)[1]


def test_no_noise_estimate_without_equivalent_rows():
    md = markdown_report([ROWS[0], ROWS[5]], [])
    assert "no noise estimate" in md


def test_maxbatch_cli_marks_the_cap(capsys):
    from memtrain.cli import main

    tiny = ["--d-model", "32", "--n-heads", "4", "--n-layers", "1", "--d-ff", "64", "--vocab-size", "256",
            "--seq-len", "16", "--method", "trace", "--memory-budget", "1GiB"]
    assert main(["maxbatch", "--max-batch", "4", *tiny]) == 0
    out = capsys.readouterr().out
    assert out.startswith("max batch 4+ ") and "raise --max-batch" in out
