"""plan shows what each choice does to the numerics and prefers the standard one when it fits."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from memtrain.analysis import fit
from memtrain.analysis.plan import Candidate, PlanResult, verify_config
from memtrain.cli import main
from memtrain.config.archs import GPT2_ARCH
from memtrain.config.run import build_config
from memtrain.devices.numerics import is_standard, numerics_note

ARGS = ["plan", "--device", "cpu", "--optims", "adamw,adamw-4bit", "--precisions", "bf16,bf16-pure", "--top", "2",
        "--json"]
RESULTS = Path(__file__).parent.parent / "benchmarks" / "results" / "cpu-quick"


def test_numerics_notes():
    assert is_standard({"precision": "bf16", "optim": "adamw"}) and is_standard({"precision": "fp16", "optim": "adamw-fused"})
    assert "changes the optimizer's arithmetic" in numerics_note({"precision": "bf16", "optim": "adamw-8bit"})
    assert "pure BF16 weights" in numerics_note({"precision": "bf16-pure", "optim": "adamw"})
    assert "changes the model" in numerics_note({"precision": "bf16", "optim": "adamw", "window": 64})


def test_plan_recommends_the_standard_choice_when_it_fits(capsys):
    assert main([*ARGS, "--memory-budget", "450MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    cands, rec = out["candidates"], out["recommended"]
    assert not cands[0]["numerics_standard"]  # the fastest changes the numerics...
    assert cands[rec]["numerics_standard"] and cands[rec]["numerics"].startswith("standard")  # ...the pick does not
    assert rec == len(cands) - 1 and len(cands) == 3  # shown beyond --top 2
    assert cands[rec]["relative_time"] >= cands[0]["relative_time"]


def test_plan_falls_back_to_the_fewest_changes_when_nothing_standard_fits(capsys):
    # Every fitting set keeps pure BF16 weights here; the fastest adds 4-bit optimizer state too.
    # The pick is the fastest that adds nothing more (it recommended #1, two changes, before).
    assert main([*ARGS, "--memory-budget", "300MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    cands, rec = out["candidates"], out["recommended"]
    assert not any(c["numerics_standard"] for c in cands)
    assert cands[0]["techniques"]["optim"] == "adamw-4bit" and rec != 0
    assert cands[rec]["techniques"] == {**cands[rec]["techniques"], "precision": "bf16-pure", "optim": "adamw"}
    assert cands[rec]["numerics"].count("changes") == 1 < cands[0]["numerics"].count("changes")


def test_plan_falls_back_to_the_fastest_when_every_choice_changes_as_much(capsys):
    assert main([*ARGS, "--optims", "adamw-4bit", "--memory-budget", "300MiB"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recommended"] == 0 and not out["candidates"][0]["numerics_standard"]


def test_plan_names_the_lora_asked_as_the_users_not_as_no_standard_choice(capsys):
    """plan never adds or drops LoRA: with --lora-rank every candidate trains adapters only. It said
    "no numerically standard choice fits" under any budget, as if a larger one would buy one; the
    LoRA asked is named as the user's, and the pick is judged on the choices plan made."""
    args = [a for a in ARGS if a != "--json"]
    assert main([*args, "--lora-rank", "8", "--memory-budget", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "no numerically standard choice" not in out
    assert "the fastest numerically standard choice (apart from what you asked: LoRA: trains adapters only" in out
    assert "#1 is faster but: " in out and "LoRA" not in out.split("#1 is faster but: ", 1)[1].splitlines()[0]
    assert main([*args, "--precisions", "bf16", "--optims", "adamw", "--lora-rank", "8",
                 "--memory-budget", "24GiB"]) == 0
    assert "(a numerically standard choice (apart from what you asked: LoRA" in capsys.readouterr().out


def test_plan_shows_the_measured_ppl_effect(tmp_path, capsys):
    if not (RESULTS / "results.jsonl").is_file():
        pytest.skip("recorded bench results not in this checkout")
    shutil.copy(RESULTS / "results.jsonl", tmp_path / "results.jsonl")
    assert main([*ARGS, "--precisions", "bf16", "--memory-budget", "450MiB", "--results", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    four_bit = [c for c in out["candidates"] if c["techniques"]["optim"] == "adamw-4bit"]
    assert four_bit and all(c["measured_ppl_effect"] > 0.01 for c in four_bit)
    assert all(c["measured_ppl_effect"] is None for c in out["candidates"] if c["numerics_standard"])
    assert main([*ARGS, "--memory-budget", "450MiB", "--results", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize("content, said", [("", "holds no rows;"),
                                            ("[1]\n{\"technique\": \"x\", \"sta\n", "(2 unreadable line(s) skipped)")],
                         ids=["empty", "unreadable"])
def test_plan_warns_when_results_hold_no_rows(tmp_path, capsys, content, said):
    (tmp_path / "results.jsonl").write_text(content)
    assert main([*ARGS, "--memory-budget", "450MiB", "--results", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning:"), captured.err
    assert f"{tmp_path}/results.jsonl holds no rows" in err[0] and said in err[0]
    assert json.loads(captured.out)["candidates"]  # the plan itself stands


def test_plan_measures_effects_only_on_the_last_benchs_rows(tmp_path, capsys):
    """Rows a bench ran under other settings (another batch, other steps) are no measure of the
    same change: plan reads the last bench's rows, as `memtrain report` does, and says how many
    it left out. Here an older bench's adamw-4bit row would have given the 4-bit candidates an
    effect; the last bench has no such row."""
    if not (RESULTS / "results.jsonl").is_file():
        pytest.skip("recorded bench results not in this checkout")
    rows = [json.loads(line) for line in (RESULTS / "results.jsonl").read_text().splitlines() if line.strip()]
    older = [{**r, "settings_hash": "0a"} for r in rows]
    last = [{**r, "settings_hash": "0b"} for r in rows if "4bit" not in str(r.get("config", {}).get("technique", {}).get("optim"))]
    assert len(last) < len(older)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in older + last))
    assert main([*ARGS, "--precisions", "bf16", "--memory-budget", "450MiB", "--results", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    four_bit = [c for c in json.loads(captured.out)["candidates"] if c["techniques"]["optim"] == "adamw-4bit"]
    assert four_bit and all(c["measured_ppl_effect"] is None for c in four_bit)
    assert f"holds {len(older)} row(s) a bench ran under other settings" in captured.err


def _judged_argv(results: Path) -> list[str]:
    """plan of BF16 AdamW against Adafactor, reading the bench results in ``results``."""
    return ["plan", "--device", "cpu", "--precisions", "bf16", "--optims", "adamw,adafactor",
            "--memory-budget", "450MiB", "--results", str(results)]


def test_plan_judges_a_measured_ppl_effect_against_the_bench_noise(capsys):
    """With a bench's nudged twins in --results, a measured effect is said to be beyond or within
    2x their spread, against the row the twins repeat (the twins are no candidate's row)."""
    nudged = RESULTS.parent / "cpu-quick-nudged"
    if not (nudged / "results.jsonl").is_file():
        pytest.skip("recorded bench results not in this checkout")
    argv = _judged_argv(nudged)
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_ppl_noise"] == pytest.approx(848.36 / 832.47 - 1, abs=1e-4)
    ada = [c for c in out["candidates"] if c["techniques"]["optim"] == "adafactor"]
    assert ada and all(c["measured_ppl_effect"] == pytest.approx(-0.0667, abs=1e-3) for c in ada)
    assert all(c["measured_ppl_beyond_noise"] is True for c in ada)
    assert all(c["measured_ppl_beyond_noise"] is None for c in out["candidates"] if c["numerics_standard"])
    assert main(argv) == 0
    assert "(measured: PPL -6.67%, beyond 2x the bench's noise of 1.91%)" in capsys.readouterr().out


def test_plan_judges_a_bf16_effect_against_the_bf16_twins(tmp_path, capsys):
    """The same results with a nudged twin of the BF16 flash row 10% from it: the BF16 candidates'
    measured effects are judged against that spread (within it), the first yardstick stays in
    measured_ppl_noise."""
    nudged = RESULTS.parent / "cpu-quick-nudged"
    if not (nudged / "results.jsonl").is_file():
        pytest.skip("recorded bench results not in this checkout")
    rows = [json.loads(line) for line in (nudged / "results.jsonl").read_text().splitlines() if line.strip()]
    twin = json.loads(json.dumps(next(r for r in rows if r["technique"] == "flash-bf16")))
    twin["technique"], twin["val_ppl"] = "flash-bf16-nudge1", twin["val_ppl"] * 1.10
    twin["val_loss"] += math.log(1.10)
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, twin]))
    argv = _judged_argv(tmp_path)
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["measured_ppl_noise"] == pytest.approx(848.36 / 832.47 - 1, abs=1e-4)
    ada = [c for c in out["candidates"] if c["techniques"]["optim"] == "adafactor"]
    assert ada and all(c["measured_ppl_beyond_noise"] is False for c in ada)
    assert all(c["measured_ppl_row_noise"] == pytest.approx(0.10, abs=1e-4) for c in ada)
    assert main(argv) == 0
    assert "(measured: PPL -6.67%, within 2x the bench's noise of 10.00%)" in capsys.readouterr().out


def test_estimate_suggests_the_fewest_numerics_changes_first_as_plan_recommends(monkeypatch):
    """With no standard change fitting, estimate --budget's first suggestion is plan's pick: the
    fastest of those that change the numerics least, not the fastest whatever it adds."""
    def candidate(optim: str, seconds: float) -> Candidate:
        return Candidate(techniques={"precision": "bf16-pure", "optim": optim}, batch_size=4, grad_accum=1,
                         peak_bytes=2**20, peak_phase="backward", step_time_s=seconds)

    # plan's answer, fastest first: 4-bit optimizer state on top of pure BF16 weights is faster by a hair
    found = [candidate("adamw-4bit", 1.0), candidate("adamw", 1.0001), candidate("adafactor", 1.2)]
    monkeypatch.setattr(fit, "plan", lambda *a, **k: PlanResult(
        budget_bytes=2**30, margin=0.0, device_type="cpu", target_batch=4, candidates=found, evaluated=3,
        baseline_step_time_s=1.0))
    cfg = build_config({"batch_size": 4})
    got = fit.cheapest_changes(cfg, GPT2_ARCH, "cpu", 2**30, None)
    assert [s["techniques"]["optim"] for s in got] == ["adamw", "adamw-4bit", "adafactor"]
    assert got[0]["numerics"].count("changes") == 1 < got[1]["numerics"].count("changes")


def test_plan_help_and_the_readme_state_the_pick_rule(capsys):
    """plan recommends by fewest numerics changes first, speed second; its --help and the README
    said "the fastest technique set that fits", which a faster set changing the numerics is not
    picked over."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    description = " ".join(capsys.readouterr().out.split("options:")[0].split())
    assert "fastest technique set" in description and "change the numerics least" in description
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8").split())
    assert "the fastest technique set that fits a budget among those that change the numerics least" in readme


def test_verify_steps_help_says_the_run_takes_at_least_two(capsys):
    """--verify runs at least 2 steps (the second is the steady state it measures): --verify-steps 1
    ran 2 and said so only after training, while --help read "Steps for --verify (default 2)"."""
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--verify-steps VERIFY_STEPS Steps for --verify (default 2; at least 2" in help_text
    techniques = {"precision": "fp32", "attention": "math", "checkpointing": "none", "loss": "standard",
                  "optim": "adamw"}
    cand = Candidate(techniques=techniques, batch_size=1, grad_accum=1, peak_bytes=1.0, peak_phase="backward", step_time_s=1.0)
    assert verify_config(build_config({}), cand, steps=1).train.steps == 2
