"""`memtrain bench` on any machine: slow BF16 rows substituted in the default list, warned about
when named, a second-seed baseline for noise, ETA lines, and the report saying all of it."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL, fake_caps
from memtrain.bench.device_rows import adapt_rows
from memtrain.bench.eta import BenchEta, fmt_duration
from memtrain.bench.runner import BenchOptions, resolve_rows, run_bench
from memtrain.bench.technique_sets import DEFAULT_TECHNIQUES, NOISE_ROWS, describe, technique_overrides
from memtrain.config.run import ConfigError
from memtrain.devices import probe as D
from memtrain.report.noise import quality_vs_noise
from memtrain.report.tables import markdown_report

pytestmark = pytest.mark.usefixtures("fresh_probe")


def test_default_list_substitutes_slow_bf16_rows():
    rows = resolve_rows(BenchOptions(techniques=DEFAULT_TECHNIQUES + NOISE_ROWS))
    out, subs, notes = adapt_rows(rows, fake_caps(), substitute=True)
    precisions = {n: c.technique.precision for n, c in out}
    assert all(p in ("fp32", "tf32") for p in precisions.values())
    assert set(subs) == {n for n, c in rows if c.technique.precision == "bf16"} and "bf16" in subs
    assert subs["bf16"]["from"] == "bf16" and subs["bf16"]["to"] == "fp32"
    assert "5.3x slower than fp32" in subs["bf16"]["reason"]
    # Other technique settings are kept: only the precision changes.
    before, after = dict(rows), dict(out)
    assert after["lowest-memory"].technique.optim == before["lowest-memory"].technique.optim == "adamw-4bit"
    assert after["window-flash"].technique.window == before["window-flash"].technique.window
    assert len(notes) == 1 and "run in fp32 here" in notes[0] and "--techniques" in notes[0]
    # Where FP16 is native, BF16 is not and FP16 measured faster than FP32, the rows run in FP16.
    out16, subs16, _ = adapt_rows(rows, fake_caps(native_fp16=True, fp16_slowdown=0.5), substitute=True)
    assert subs16["bf16"]["to"] == "fp16" and dict(out16)["bf16"].technique.precision == "fp16"
    # Native BF16: nothing changes, nothing is said.
    assert adapt_rows(rows, fake_caps(native_bf16=True), substitute=True) == (rows, {}, [])


@pytest.mark.parametrize("fp16_slowdown, expected", [(0.5, "fp16"), (0.99, "fp16"), (1.0, "fp32"), (1.3, "fp32"),
                                                    (None, "fp16")])
def test_substitute_for_bf16_is_the_faster_measured_native_precision(fp16_slowdown, expected):
    """Native FP16 replaces a slow BF16 only where its measured GEMM is faster than FP32's (an AMX
    Xeon measured FP16 1.3x slower than FP32); unmeasured (a GPU probed without kernels) it is
    taken on its native answer."""
    rows = resolve_rows(BenchOptions(techniques=["baseline", "bf16"]))
    caps = fake_caps(native_fp16=True, fp16_slowdown=fp16_slowdown)
    out, subs, notes = adapt_rows(rows, caps, substitute=True)
    assert dict(out)["bf16"].technique.precision == subs["bf16"]["to"] == expected
    assert dict(out)["baseline"].technique.precision == "tf32"
    passed_over = "fp16 is native here but measured 1.3x slower than fp32"
    assert (passed_over in notes[0]) == (fp16_slowdown == 1.3)
    assert (subs["bf16"].get("fp16_passed_over") == passed_over) == (fp16_slowdown == 1.3)
    # Without native FP16 the measured rate does not matter: FP32.
    out, _, _ = adapt_rows(rows, fake_caps(native_fp16=False, fp16_slowdown=0.5), substitute=True)
    assert dict(out)["bf16"].technique.precision == "fp32"


def test_report_says_why_fp16_was_passed_over():
    note = "fp16 is native here but measured 1.3x slower than fp32"
    row = _row("bf16", 1000.0, substituted={"from": "bf16", "to": "fp32", "reason": "slow", "fp16_passed_over": note})
    md = markdown_report([row], [])
    assert "BF16 rows ran in FP32, the faster of the native precisions here (FP16 is native here but measured " \
           "1.3x slower than FP32)" in md


def test_named_rows_run_as_asked_with_one_warning():
    rows = resolve_rows(BenchOptions(techniques=["baseline", "bf16", "ckpt-bf16"]))
    out, subs, notes = adapt_rows(rows, fake_caps(), substitute=False)
    assert out == rows and subs == {}
    assert len(notes) == 1
    assert notes[0].startswith("--precision bf16: bf16 matmul here is 5.3x slower than fp32; this CPU has no native BF16")
    assert notes[0].endswith("Rows: bf16, ckpt-bf16.")


SEED_TWIN = "baseline-seed2"


def test_seed_twin_is_the_preset_with_the_next_seed():
    rows = dict(resolve_rows(BenchOptions(techniques=["baseline", SEED_TWIN], overrides={"seed": 7})))
    assert rows["baseline"].train.seed == 7 and rows[SEED_TWIN].train.seed == 8
    assert rows[SEED_TWIN].technique == rows["baseline"].technique and rows[SEED_TWIN].train.nudge_seed == 0
    assert technique_overrides(SEED_TWIN, "quick") == technique_overrides("baseline", "quick")
    assert describe(SEED_TWIN).endswith("seed + 1 (noise)")


def test_nudged_twins_are_the_preset_with_its_seed_and_a_nudge():
    """The default list's twins keep the row's seed (weights, batch order) and differ only in the
    nudge; a nudge seed outside 1-99 is no twin but an unknown technique."""
    rows = dict(resolve_rows(BenchOptions(techniques=["baseline", *NOISE_ROWS], overrides={"seed": 7})))
    assert NOISE_ROWS == ["baseline-nudge1", "baseline-nudge2", "flash-bf16-nudge1"]
    assert describe("flash-bf16-nudge1") == "FlashAttention + BF16, weights nudged 1 (noise)"
    for n, name in enumerate(NOISE_ROWS[:2], 1):
        assert rows[name].replace(nudge_seed=0) == rows["baseline"] and rows[name].train.nudge_seed == n
        assert describe(name) == f"Baseline (TF32/FP32), weights nudged {n} (noise)"
    for bad in ("baseline-nudge0", "baseline-nudge100", "nosuch-nudge1", "baseline-seed3"):
        with pytest.raises(ConfigError, match=r"unknown technique .*a noise twin is PRESET-nudgeN, N = 1-99, or PRESET-seed2"):
            resolve_rows(BenchOptions(techniques=[bad]))


def _row(name: str, ppl: float, **extra) -> dict:
    return {"technique": name, "description": describe(name), "status": "ok", "val_ppl": ppl,
            "config": {"model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64, "vocab_size": 50257},
                       "train": {"batch_size": 4, "seq_len": 32, "steps": 30, "lr": 1e-3, "warmup_steps": 3},
                       "data": {"data": "default"}, "technique": {"precision": extra.pop("precision", "fp32")}},
            "memory": {"peak_bytes": 1, "by_category": {}}, "step_time_s": {"median": 0.1}, "env": {"device": "cpu"},
            **extra}


def test_noise_section_and_device_header():
    caps = {"name": "Test CPU", "native_bf16": False, "bf16_reason": "no avx512_bf16/amx_bf16 flag",
            "bf16_slowdown": 5.3, "precision_native": True}
    ref = {"kind": "measured_gemm", "name": "Test CPU, measured FP32 GEMM 512x512x512", "flops_per_s": 50e9}
    rows = [
        _row("baseline", 1000.0, device_caps=caps, mfu=0.2, mfu_reference=ref),
        _row("bf16", 1005.0, device_caps=caps, substituted={"from": "bf16", "to": "fp32", "reason": "slow"}),
        _row("window-flash", 1100.0, device_caps=caps),
        _row("ckpt-bf16", 1001.0, precision="bf16", device_caps={**caps, "precision_native": False}),
        _row(SEED_TWIN, 1010.0, device_caps=caps),
    ]
    q = quality_vs_noise(rows)
    assert q["rel_noise"] == pytest.approx(0.01)
    verdict = {r["technique"]: (round(r["times_noise"], 2), r["beyond_noise"]) for r in q["rows"]}
    assert verdict == {"bf16": (0.5, False), "window-flash": (10.0, True), "ckpt-bf16": (0.1, False)}
    md = markdown_report(rows, [])
    assert "Device: Test CPU; **no native BF16** (no avx512_bf16/amx_bf16 flag); a BF16 matmul measured 5.3x slower" in md
    assert "BF16 Mixed Precision [ran in FP32*]" in md and "BF16 rows ran in FP32" in md
    assert "Rows that ran a precision without a native kernel here (slow): Grad Checkpointing + BF16." in md
    assert "measured GEMM rate, not a datasheet peak" in md and "50.0 GFLOP/s" in md
    assert "## Quality against run-to-run noise" in md and "a 1.00% difference" in md
    assert "| Windowed Attn + FlashAttn | 1100.00 | +10.00% | 1.00% | 10.0 | yes |" in md
    assert "evaluated on the same" not in md  # the rows do not say what they were evaluated on
    assert quality_vs_noise(rows[:4]) is None  # no second seed: no noise section
    assert "run-to-run noise" not in markdown_report(rows[:4], [])


def test_eta_line_after_first_timed_step(tmp_path):
    hb = tmp_path / "hb.json"
    eta = BenchEta(rows_to_run=3)
    assert eta.line("a", hb, 1.0) is None  # no heartbeat yet
    hb.write_text(json.dumps({"done": 3, "total": 20, "step_s": None}))
    assert eta.line("a", hb, 2.0) is None  # still in the timing warm-up
    hb.write_text(json.dumps({"done": 4, "total": 20, "step_s": 0.5}))
    line = eta.line("a", hb, 4.0)
    # Before a row has finished, both figures leave out evaluation and the max-batch search, and say
    # so (the bench's said "~32s left" of a bench whose max-batch searches took minutes).
    assert line == ("[a] eta: 0.50 s/step, row ~8s left + evaluation and max-batch search; bench ~32s left + each "
                    "row's evaluation and max-batch search (2 more rows after this)")
    assert eta.line("a", hb, 5.0) is None  # once per row
    eta.row_finished({"row_wall_s": 20.0, "total_time_s": 10.0})
    hb.write_text(json.dumps({"done": 10, "total": 20, "step_s": 1.0}))
    # 10 steps left (10 s) + overhead 10 s of which 2 s (elapsed 12 - trained 10) already spent.
    assert eta.line("b", hb, 12.0) == "[b] eta: 1.00 s/step, row ~18s left; bench ~38s left (1 more row after this)"
    last = BenchEta(rows_to_run=1)
    assert last.line("c", hb, 12.0) == ("[c] eta: 1.00 s/step, row ~10s left + evaluation and max-batch search; "
                                        "bench ~10s left + evaluation and max-batch search (0 more rows after this)")
    assert fmt_duration(75) == "1m15s" and fmt_duration(3 * 3600 + 120) == "3h02m"


def test_bench_default_list_on_cpu_without_native_bf16(small_corpus, tmp_path, monkeypatch, capsys):
    """Two real rows in subprocesses with the no-native-BF16 answer forced: the BF16 row runs in
    FP32 and says so; its noise twin runs with the next seed; the report has both."""
    monkeypatch.setenv(D.FORCE_BF16_ENV, "0")
    # And no native FP16: with it, the row would run in whichever of FP16/FP32 this CPU measures faster.
    monkeypatch.setenv(D.FORCE_FP16_ENV, "0")
    overrides = {**TINY_MODEL, "data": str(small_corpus), "steps": 3, "warmup_steps": 1, "batch_size": 2,
                 "seq_len": 32, "val_blocks": 2}
    opts = BenchOptions(techniques=["bf16", "bf16-seed2"], out=tmp_path / "b", overrides=overrides,
                        maxbatch=False, progress=False, substitute_slow=True)
    rows = run_bench(opts)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert rows[0]["config"]["technique"]["precision"] == "fp32" and rows[0]["substituted"]["to"] == "fp32"
    assert rows[1]["config"]["train"]["seed"] == rows[0]["config"]["train"]["seed"] + 1
    assert rows[0]["device_caps"]["forced"] == "MEMTRAIN_FORCE_NATIVE_BF16=0, MEMTRAIN_FORCE_NATIVE_FP16=0"
    assert rows[0]["mfu_reference"]["kind"] == "measured_gemm" and 0 < rows[0]["mfu"] <= 1
    err = capsys.readouterr().err
    assert err.count("warning: bf16 rows of the default list run in fp32 here") == 1
    md = (tmp_path / "b" / "report.md").read_text()
    assert "[ran in FP32*]" in md and "**no native BF16**" in md and "## Quality against run-to-run noise" in md


def test_noise_section_says_what_the_twin_changes_and_on_how_many_tokens():
    """The twin's seed is all that differs from the baseline, and the PPL is read on --val-blocks
    blocks of --seq-len tokens, fewer where the held-out split is shorter."""
    def row(name: str, ppl: float, held_out: int) -> dict:
        r = _row(name, ppl, data={"val_tokens": held_out})
        r["config"]["data"]["val_blocks"] = 64
        return r

    md = markdown_report([row("baseline", 1000.0, 54_288), row("bf16", 1005.0, 54_288),
                          row(SEED_TWIN, 1010.0, 54_288)], [])
    assert ("differs from `baseline` in its seed only (other initial weights and batch order); both, and every "
            "row, are evaluated on the same 64 validation blocks (2,048 tokens).") in md
    short = markdown_report([row("baseline", 1000.0, 33 * 10), row(SEED_TWIN, 1010.0, 33 * 10)], [])
    assert "the same 10 validation blocks (320 tokens)" in short


def test_twins_equal_to_the_digit_leave_every_row_unjudged():
    """At 60 steps on an H100 the nudged twins matched the baseline's PPL exactly: no noise was
    measured, so no row may be called beyond (or within) it; the report says the noise was not
    measurable and lists the differences unjudged."""
    from memtrain.report.recommend import _ppl_lines

    rows = [_row("baseline", 1000.0), _row("baseline-nudge1", 1000.0), _row("baseline-nudge2", 1000.0),
            _row("window-flash", 1000.5), _row("ckpt-bf16", 1000.0, precision="bf16")]
    q = quality_vs_noise(rows)
    assert q["rel_noise"] == 0
    assert {r["technique"]: r["beyond_noise"] for r in q["rows"]} == {"window-flash": None, "ckpt-bf16": None}
    md = markdown_report(rows, [])
    assert "the noise could not be measured and no row is judged against it" in md
    assert "| Windowed Attn + FlashAttn | 1000.50 | +0.05% | 0.00% | n/a | unknown |" in md
    line = _ppl_lines(rows, rows)[0]
    assert line.startswith("- Perplexity: the noise could not be measured") and "+0.05%" in line
    assert "beyond noise" not in line
