"""The bench report marks capped max batches, explains zero categories and recommends."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from memtrain.report.tables import markdown_report, table_rows

CATS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def _row(tech, step, peak, loss, precision="bf16", optim="adamw", window=None, probes=(True, False, True),
         mb=10, temporaries=5.0, phase="backward", spread=(0.0, 0.0)):
    by = {"parameters": 1.0, "gradients": 0, "optimizer": 2.0, "activations": 3.0, "temporaries": temporaries}
    return {
        "technique": tech, "description": tech, "status": "ok",
        "config": {"train": {"batch_size": 4, "seq_len": 8, "steps": 2, "lr": 1e-3, "warmup_steps": 1},
                   "model": {"d_model": 8, "n_layers": 1, "n_heads": 1, "d_ff": 8, "vocab_size": 10, "vocab_multiple": 1},
                   "technique": {"precision": precision, "optim": optim, "window": window, "lora_rank": 0},
                   "data": {"data": "default"}},
        "memory": {"peak_bytes": peak, "by_category": {c: by[c] * 2**20 for c in CATS}, "peak_phase": phase},
        "step_time_s": {"median": step, "p10": step - spread[0], "p90": step + spread[1]}, "total_time_s": 1.0, "tokens_per_s": 1.0,
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


def _rec_section(rows):
    return markdown_report(rows, []).split("## Recommendation")[1]


def test_the_noise_twin_is_never_recommended():
    """The twin of the baseline ran faster by chance: the recommendation names a technique."""
    rows = [_row("baseline", 0.874, 0.5 * 2**30, 9.31, precision="tf32"),
            _row("chunked", 1.066, 0.3 * 2**30, 9.31),
            _row("baseline-seed2", 0.869, 0.5 * 2**30, 9.0, precision="tf32")]
    rec = _rec_section(rows)
    assert "baseline-seed2" not in rec.split("- Step-time noise")[0]
    assert "**baseline**" in rec
    # Even when the twin alone fits the budget, it is not named: no row is recommended then.
    alone = [_row("baseline", 0.874, 2 * 2**30, 9.31), _row("baseline-seed2", 0.869, 0.5 * 2**30, 9.0)]
    assert "**baseline-seed2**" not in _rec_section(alone)


def test_rows_equally_fast_within_the_twins_timing_noise_are_picked_by_memory():
    """The same computation timed twice differed by 20%; a row 15% faster than another is not called
    faster: the two are equally fast within noise and the smaller peak is recommended."""
    rows = [_row("baseline", 1.00, 0.5 * 2**30, 9.31, precision="tf32"),
            _row("fast-big", 0.85, 0.6 * 2**30, 9.31),
            _row("small", 0.98, 0.2 * 2**30, 9.31),
            _row("slow", 3.00, 0.1 * 2**30, 9.31),
            _row("baseline-seed2", 1.20, 0.5 * 2**30, 9.0, precision="tf32")]
    rec = _rec_section(rows)
    fastest = next(ln for ln in rec.splitlines() if ln.startswith("- Fastest"))
    assert "equally fast within noise" in fastest and fastest.endswith("**small**, 0.980 s/step (p10-p90 0.980-0.980), "
                                                                       "peak 0.200 GiB.")
    assert "fast-big (0.850 s/step)" in fastest and "baseline (1.000 s/step)" in fastest
    assert "slow" not in fastest  # 3x slower: beyond 2 x 20%
    assert "`baseline` and its twins, the same computation, took 1.000 (`baseline-seed2` 1.200) s/step, at most 20.00% apart" in rec
    # The same rows with a twin that agreed to 1%: fast-big is faster beyond noise and is recommended.
    rows[-1] = _row("baseline-seed2", 1.01, 0.5 * 2**30, 9.0, precision="tf32")
    fastest = next(ln for ln in _rec_section(rows).splitlines() if ln.startswith("- Fastest"))
    assert fastest.startswith("- Fastest row that fits 1.00 GiB (tracked peak): **fast-big**, 0.850 s/step")


def test_overlapping_step_time_spreads_are_a_tie():
    """Without a twin, a row's own spread decides: ranges that overlap cannot tell two rows apart."""
    rows = [_row("a", 1.00, 0.5 * 2**30, 9.31, spread=(0.1, 0.3)),
            _row("b", 1.20, 0.3 * 2**30, 9.31, spread=(0.15, 0.1)),
            _row("c", 2.00, 0.2 * 2**30, 9.31, spread=(0.2, 0.2))]
    rec = _rec_section(rows)
    assert "a (1.000 s/step), b (1.200 s/step) are equally fast within noise" in rec and "**b**" in rec
    assert "no row was timed twice" in rec
    md = markdown_report(rows, [])
    assert "| Step p10-p90 (s) |" in md and "| 0.900-1.300 |" in md and "| 1.050-1.300 |" in md
    # Apart (a's p90 below b's p10): a is faster.
    rows[0] = _row("a", 1.00, 0.5 * 2**30, 9.31, spread=(0.1, 0.01))
    assert "Fastest row that fits 1.00 GiB (tracked peak): **a**" in _rec_section(rows)


def test_one_noise_figure_for_the_seed_pair():
    """The noise section and the recommendation give the seed-to-seed PPL noise as one figure: the
    larger PPL over the smaller (symmetric, whichever of the two ran first)."""
    rows = [_row("baseline", 1.0, 0.5 * 2**30, math.log(1579.99), precision="tf32"),
            _row("window", 1.0, 0.5 * 2**30, math.log(1711.50), window=4),
            _row("baseline-seed2", 1.0, 0.5 * 2**30, math.log(1035.68), precision="tf32")]
    md = markdown_report(rows, [])
    assert "a 52.56% difference" in md and "more than 2x the seed-to-seed difference of 52.56%" in md
    assert "34.4" not in md  # the same pair relative to the baseline's PPL is not given beside it


def test_rows_are_judged_against_the_twins_of_their_own_precision():
    """A nudged twin of a BF16 row: BF16 rows are judged against its spread where that is the
    larger (rounding grows otherwise in BF16), FP32 rows against the FP32 twins; a BF16 twin that
    spread less than the FP32 twins changes nothing (never less than the first yardstick). The
    recommendation names both figures."""
    def r(name, ppl, **kw):
        return _row(name, 1.0, 0.5 * 2**30, math.log(ppl), **kw)

    fp32 = [r("baseline", 833.22, precision="tf32"), r("baseline-nudge1", 828.61, precision="tf32"),
            r("baseline-nudge2", 835.16, precision="tf32"), r("ckpt-fp32", 845.0, precision="tf32"),
            r("flash", 826.73), r("chunked", 849.08), r("window", 863.43)]
    md = markdown_report([*fp32, r("flash-nudge1", 951.52)], [])
    assert ("rows computing in bf16 are judged against `flash` (826.73) and its nudged twin (`flash-nudge1` 951.52), "
            "15.09% apart") in md
    assert "| chunked | 849.08 | +1.90% | 15.09% | 0.1 | no |" in md
    assert "| window | 863.43 | +3.63% | 15.09% | 0.2 | no |" in md
    assert "| ckpt-fp32 | 845.00 | +1.41% | 0.79% | 1.8 | no |" in md  # FP32: the FP32 twins' 0.79%
    assert "of 0.79%; bf16 rows: 15.09%, `flash`'s twins, see the noise section): none." in md
    calm = markdown_report([*fp32, r("flash-nudge1", 827.0)], [])  # 0.03% apart: the FP32 0.79% stands
    assert "| chunked | 849.08 | +1.90% | 0.79% | 2.4 | yes |" in calm
    assert "bf16 rows:" not in calm
    # FP32 twins equal to the digit (no FP32 yardstick): the BF16 rows are still judged, by theirs.
    flat32 = [r("baseline", 833.22, precision="tf32"), r("baseline-nudge1", 833.22, precision="tf32"),
              r("flash", 826.73), r("flash-nudge1", 836.0), r("window", 1000.0)]
    flat_md = markdown_report(flat32, [])
    assert "| window | 1000.00 | +20.02% | 1.12% | 17.9 | yes |" in flat_md
    assert "could not be measured (the twins" not in flat_md and "): window (+20.02%)." in flat_md


def test_nudged_twins_are_the_yardstick_and_the_seed_twin_a_reference():
    """With nudged twins the noise is the largest difference among the row and its twins; a row
    beyond 2x that is called a difference. A seed twin beside them is reported, not used."""
    def r(name, ppl, **kw):
        return _row(name, 1.0, 0.5 * 2**30, math.log(ppl), **kw)

    rows = [r("baseline", 832.47, precision="tf32"), r("bf16", 823.66), r("window", 867.54, window=4),
            r("lowest", 776.95), r("baseline-nudge1", 848.36, precision="tf32"),
            r("baseline-nudge2", 834.02, precision="tf32")]
    md = markdown_report(rows, [])
    assert ("nudged by one rounding (`baseline-nudge1` 848.36, `baseline-nudge2` 834.02): the largest difference "
            "among these 3 runs is 1.91%") in md
    assert "| bf16 | 823.66 | -1.06% | 1.91% | 0.6 | no |" in md and "| window | 867.54 | +4.21% | 1.91% | 2.2 | yes |" in md
    noise_table = md.split("## Quality against run-to-run noise")[1].split("##")[0]
    assert "| lowest | 776.95 | -6.67% | 1.91% | 3.5 | yes |" in noise_table and "| baseline-nudge" not in noise_table
    assert ("more than 2x the nudged twins' spread of 1.91%, see the noise section): window (+4.21%), "
            "lowest (-6.67%).") in md
    assert "add `baseline-seed2` to --techniques" in md
    assert "did not grow" not in md
    flat = [r("baseline", 900.0, precision="tf32"), r("bf16", 900.5), r("baseline-nudge1", 900.0, precision="tf32")]
    flat_md = markdown_report(flat, [])
    assert "in a run this short a rounding did not grow, so the noise could not be measured" in flat_md
    assert "| bf16 | 900.50 | +0.06% | 0.00% | n/a | unknown |" in flat_md
    with_seed = markdown_report(rows + [r("baseline-seed2", 889.20, precision="tf32")], [])
    assert "Seed-to-seed, for reference: `baseline-seed2` 889.20" in with_seed and "6.81% from `baseline`" in with_seed
    assert "spread of 1.91%" in with_seed  # still the yardstick
    # Timing: the base and both twins are one computation timed three times.
    rec = _rec_section(rows)
    assert "took 1.000 (`baseline-nudge1` 1.000, `baseline-nudge2` 1.000) s/step, at most 0.00% apart" in rec


def test_plots_name_the_run_scale_and_budget_and_keep_the_cap_mark(tmp_path, monkeypatch):
    """Every plot title names the scale, batch x sequence, steps and the max-batch budget; the
    max-batch plot writes a capped search as "256+", as the table does."""
    import matplotlib.pyplot as plt

    import memtrain.report.plots as plots
    from memtrain.report.plots import write_plots

    drawn = {}

    def record(fig, path, dpi=120):  # in place of the atomic PNG write: what each figure shows
        ax = fig.axes[0]
        drawn[Path(path).name] = (ax.get_title(), [t.get_text().strip() for t in ax.texts])
        plt.close(fig)

    monkeypatch.setattr(plots, "save_figure", record)
    write_plots(table_rows([{**r, "scale": "quick"} for r in ROWS]), tmp_path)
    assert set(drawn) == {"peak_memory.png", "step_time.png", "max_batch.png", "memory_vs_time.png"}
    for title, _ in drawn.values():
        assert title.endswith("\nscale quick; batch 4 x seq 8; 2 steps; max-batch budget 1.00 GiB"), title
    labels = drawn["max_batch.png"][1]
    assert "256+" in labels and "10" in labels and "10+" not in labels


def test_the_header_names_a_technique_setting_every_row_shares():
    """A --config key (lora_rank: 4) applies to every row, under names ("BF16 Mixed Precision")
    that do not mention it: the header says so. A setting that shaped only some rows (LoRA's
    alpha beside a row without LoRA) is not shared; one row's name says all."""
    def with_tech(row, **tech):
        row["config"]["technique"].update(tech)
        row["named_settings"] = ["lora_rank"] if row["technique"] == "lora" else ["precision"]  # the bench's record
        return row

    assert "Every row also ran with" not in markdown_report(ROWS, [])
    lora = [with_tech(_row("bf16", 0.40, 2**30, 9.3), lora_rank=4, lora_alpha=32.0),
            with_tech(_row("flash-bf16", 0.38, 2**30, 9.3), lora_rank=4, lora_alpha=32.0)]
    assert "Every row also ran with: `lora_rank=4, lora_alpha=32.0` (beside what its name says)." \
        in markdown_report(lora, [])
    assert "Every row also ran with" not in markdown_report(lora[:1], [])
    mixed = [with_tech(_row("bf16", 0.40, 2**30, 9.3), lora_alpha=32.0),
             with_tech(_row("lora", 0.38, 2**30, 9.3), lora_rank=4, lora_alpha=32.0)]
    assert "Every row also ran with" not in markdown_report(mixed, [])


def _table(md: str, first_header: str, method: str) -> dict[str, str]:
    """The cells of ``method``'s row in the report table whose header row starts ``first_header``,
    by header."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    headers = [h.strip() for h in lines[start].strip("|").split("|")]
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == method:
            return dict(zip(headers, cells))
    raise AssertionError(f"no row {method!r}")


def test_each_column_shows_its_own_figure_in_its_unit():
    """Every figure of the main table and the breakdown sits under its own header, in the unit
    the header names: GiB and MiB (2**30, 2**20), seconds, a percentage, the estimate's error
    against the tracked peak with its sign (an estimate above the peak is +)."""
    row = _row("probe", 0.25, 1.5 * 2**30, math.log(20.5), spread=(0.05, 0.1), mb=12)
    row["memory"]["max_allocated_bytes"] = 2 * 2**30
    row["memory"]["by_category"]["gradients"] = 4 * 2**20  # a zero category would be left out
    row.update(total_time_s=12.34, tokens_per_s=4096.7, mfu=0.1234, estimate={"peak_bytes": 1.65 * 2**30})
    md = markdown_report([row], [])
    main = _table(md, "Method", "probe")
    assert main["Max Batch"] == "12"
    assert main["Peak Memory (GiB, tracked)"] == "1.500" and main["Peak Allocated (GiB, CUDA)"] == "2.000"
    assert main["Step Time (s)"] == "0.250" and main["Step p10-p90 (s)"] == "0.200-0.350"
    assert main["Time, 2 steps (s)"] == "12.3" and main["Tokens/s"] == "4,096"
    assert main["MFU"] == "12.3%" and main["Val PPL"] == "20.50"
    assert main["Estimate (GiB)"] == "1.650" and main["Est. vs tracked"] == "+10.0%"
    rec = table_rows([row])[0]
    assert rec["estimate_error"] == pytest.approx(0.1)
    breakdown = md[md.index("| Method | Parameters (MiB)"):]
    cells = _table(breakdown, "Method", "probe")
    assert [cells[f"{c.capitalize()} (MiB)"] for c in CATS] == ["1.0", "4.0", "2.0", "3.0", "5.0"]
    assert cells["Peak (MiB)"] == "1536.0"


def _answers_rows() -> list[dict]:
    """ROWS as --loss-on completion rows: their val_ppl averages the answer tokens only."""
    return [{**r, "config": {**r["config"], "data": {"data": "chat.jsonl", "data_format": "chat",
                                                     "loss_on": "completion"}}} for r in ROWS]


def test_a_perplexity_over_answer_tokens_is_labelled_so_under_its_own_key():
    """--loss-on completion rows: the Val PPL column (and the noise table's) averaged answer tokens only
    and said nothing; the header names them and a line says so, while report.json/csv keep val_ppl.
    Rows over every token keep the plain header."""
    rows = _answers_rows()
    md = markdown_report(rows, [])
    assert "| Val PPL (answer tokens) |" in md and "| Val PPL |" not in md
    assert "over the answer tokens of the validation blocks only (`--loss-on completion`)" in md
    assert all("val_ppl" in rec for rec in table_rows(rows))
    plain = markdown_report(ROWS, [])
    assert "| Val PPL |" in plain and "answer tokens" not in plain


def test_the_benchs_line_per_row_says_its_perplexity_is_over_answer_tokens(monkeypatch, capsys, tmp_path):
    """bench's stderr line per finished row: `val ppl X (on answer tokens only)` under --loss-on completion."""
    import memtrain.commands.bench as bench_command
    from memtrain.cli import main

    answers, plain = _answers_rows()[0], ROWS[0]

    def fake_run_bench(opts, on_row=None, **resolved):
        on_row("chunked", answers)
        on_row("baseline", plain)
        raise KeyboardInterrupt  # stop where the report would be written

    monkeypatch.setattr(bench_command, "run_bench", fake_run_bench)
    main(["bench", "--techniques", "baseline", "--out", str(tmp_path / "b"), "--no-maxbatch", "--steps", "2",
          "--no-progress"])
    err = capsys.readouterr().err
    assert f"[chunked] ok: val ppl {answers['val_ppl']:.1f} (on answer tokens only), step" in err
    assert f"[baseline] ok: val ppl {plain['val_ppl']:.1f}, step" in err


@pytest.mark.parametrize("answers", [False, True])
def test_the_scatter_plot_says_its_perplexity_is_over_answer_tokens(tmp_path, monkeypatch, answers):
    """The memory vs step time plot labels each point with its perplexity: over answer tokens only under
    --loss-on completion, which its title now says."""
    import json as json_module

    import memtrain.report.plots as plots
    from memtrain.report import write_report

    titles = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, dpi=120: titles.append(fig.axes[0].get_title()))
    rows = _answers_rows() if answers else ROWS
    (tmp_path / "results.jsonl").write_text("".join(json_module.dumps(r) + "\n" for r in rows))
    write_report(tmp_path)
    scatter = [t for t in titles if t.startswith("Memory vs step time")]
    assert len(scatter) == 1
    assert ("over answer tokens" in scatter[0]) == answers


def test_the_recommendation_states_a_small_models_peaks_in_mib_or_kib():
    """The peaks of a small model's rows (1.10 MiB and 843.81 KiB on a 2-layer Qwen2 at seq 32) read
    `peak 0.001 GiB` for each: the sentence named no difference between them. From 10 MiB up the
    peak stays in GiB to 3 decimals, as the table's column has it."""
    rows = [_row("fp32", 0.283, 1.10 * 2**20, 5.83), _row("lora", 0.076, 843.81 * 2**10, 5.99)]
    rec = _rec_section(rows)
    assert "0.001 GiB" not in rec
    assert "**lora**, 0.076 s/step (p10-p90 0.076-0.076), peak 843.81 KiB." in rec
    from memtrain.report.recommend import peak_text  # after the report's own lines: they are the fix

    assert peak_text(1.10 * 2**20) == "1.10 MiB" and peak_text(0.2 * 2**30) == "0.200 GiB"
    assert peak_text(0.01 * 2**30) == "0.010 GiB" and peak_text(0.0099 * 2**30) == "10.14 MiB"


def test_the_recommendation_finds_rows_tied_within_noise_by_identity_not_by_comparing_rows():
    """Rows whose p10-p90 ranges all overlap are tied within noise; each was looked up in that
    list by dict equality, quadratic in the rows (20,000 such rows took 3.4 s of CPU, 40,000
    15.8 s). Looked up by identity: no row is compared with another (counted, not timed)."""
    from memtrain.report.recommend import _fastest_lines

    compared = [0]

    class Row(dict):
        def __eq__(self, other):  # what `row in list_of_rows` calls on each element
            compared[0] += 1
            return dict.__eq__(self, other)

        __hash__ = None

    rows = [Row(technique=f"t{i}", method="m", step_time_s=1.0 + i, step_time_p10_s=0.5, step_time_p90_s=1e9,
                peak_tracked_bytes=10_000 + i) for i in range(2_000)]
    lines = _fastest_lines(rows, None, "fits", 0.05)
    assert compared[0] == 0, f"{compared[0]:,} row comparisons for {len(rows):,} rows"
    assert "equally fast within noise" in lines[0] and lines[1].endswith("1.000 s/step.")  # the first row: the least peak
