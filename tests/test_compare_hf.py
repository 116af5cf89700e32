"""Building blocks of the HF comparison (memtrain.bench.hf, run as benchmarks/compare_hf.py): the
HF side must train the same model on the same tokens with the same schedule and be measured by the
same meters, or the comparison means nothing."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Optional

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from memtrain.bench import runner as bench_runner  # noqa: E402
from memtrain.bench.hf.cli import main  # noqa: E402
from memtrain.bench.hf.data import hf_train_dataset  # noqa: E402
from memtrain.bench.hf.hf_model import build_hf_model  # noqa: E402
from memtrain.bench.hf.lockstep import Baton, run_pair, window_overlap_s  # noqa: E402
from memtrain.bench.hf.mapping import TRAINER_LOW_BIT_BLOCK, hf_plan  # noqa: E402
from memtrain.bench.hf.probe import hf_step_peak, profile_phases  # noqa: E402
from memtrain.bench.hf.report import aggregate, checkpointing_cost_lines, render_markdown  # noqa: E402
from memtrain.bench.hf.rows import REPORT_JSON, REPORT_MD, RUNS_FILE, config_hash, resolve_rows  # noqa: E402
from memtrain.bench.hf.trainer_side import (  # noqa: E402
    _checkpointing_for_installed,
    checkpointing_of,
    enable_checkpointing,
    make_hf_optimizer,
    run_theirs,
    training_arguments,
)
from memtrain.bench.scales import scale_overrides  # noqa: E402
from memtrain.bench.technique_sets import TECHNIQUES, technique_overrides  # noqa: E402
from memtrain.config.run import ConfigError, build_config  # noqa: E402
from memtrain.models.gpt import GPT  # noqa: E402
from memtrain.runtime.env import seed_everything  # noqa: E402

TINY = {"vocab_size": 512, "d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_seq_len": 32,
        "dropout": 0.0, "seq_len": 16, "batch_size": 2, "progress": False}


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def quick(name: str, **extra):
    return build_config(scale_overrides("quick"), technique_overrides(name, "quick"), {"progress": False, **extra})


# ----------------------------------------------------------------------------- mapping
def test_every_preset_has_a_plan_with_the_expected_status():
    plans = {name: hf_plan(quick(name), "cpu") for name in TECHNIQUES}
    assert plans["baseline"].status == "matched"
    assert plans["baseline"].attn_implementation == "eager"
    assert plans["baseline"].training_args["optim"] == "adamw_torch"
    assert plans["baseline"].matmul_precision == "high"  # tf32 on CPU: the same global switch as memtrain
    assert plans["bf16"].training_args["bf16"] is True
    assert plans["flash-bf16"].attn_implementation == "sdpa"
    assert plans["window-flash"].status == "none" and "window" in plans["window-flash"].missing[0]
    ck = plans["ckpt-bf16"].training_args
    assert ck["activation_checkpointing"] is True and ck["activation_checkpointing_kwargs"] == {"use_reentrant": False}
    assert plans["chunked-loss"].status == "closest" and "Liger" in plans["chunked-loss"].missing[0]
    assert plans["adamw-8bit"].training_args["optim"] == "adamw_torch_8bit"
    assert plans["adafactor"].training_args["optim"] == "adafactor"
    assert plans["lowest-memory"].training_args["optim"] == "adamw_torch_4bit"
    assert plans["lora"].lora["target_modules"] == ["attn.c_proj", "c_attn", "c_fc", "mlp.c_proj"]
    assert plans["compile"].training_args["torch_compile"] is True


def test_trainer_optimizer_is_the_one_memtrain_reads_back():
    """The Trainer's optim name comes from memtrain.config.aliases' one table of optimizer names: read
    back on memtrain's command line it names the same optimizer (adamw-foreach: adamw's name,
    TrainingArguments having no foreach switch)."""
    from memtrain.config.aliases import normalize_value
    from memtrain.config.run import OPTIMS

    for optim in OPTIMS:
        name = hf_plan(quick("baseline", optim=optim), "cpu").training_args["optim"]
        assert normalize_value("optim", name) == ("adamw" if optim == "adamw-foreach" else optim)


def test_plan_edge_cases():
    every = hf_plan(quick("bf16", checkpointing="every:2"), "cpu")
    assert every.training_args["activation_checkpointing_kwargs"]["every_n_layers"] == 2
    assert hf_plan(quick("bf16", checkpointing="selective"), "cpu").status == "closest"
    assert hf_plan(quick("bf16", precision="bf16-pure"), "cpu").status == "none"
    assert hf_plan(quick("bf16", distributed="ddp"), "cpu").status == "none"
    assert hf_plan(quick("baseline"), "cuda").training_args["tf32"] is True


def test_checkpointing_reaches_a_trainer_from_before_the_rename():
    """transformers releases before activation_checkpointing (5.17 on the GPU image) take the same
    request as gradient_checkpointing*; every k layers, which they cannot do, is one error line."""
    @dataclasses.dataclass
    class OldArguments:  # the fields of an older TrainingArguments
        gradient_checkpointing: bool = False
        gradient_checkpointing_kwargs: Optional[dict] = None

    full = hf_plan(quick("bf16", checkpointing="full"), "cpu").training_args
    old = _checkpointing_for_installed(dict(full), OldArguments)
    assert "activation_checkpointing" not in old and "activation_checkpointing_kwargs" not in old
    assert old["gradient_checkpointing"] is True and old["gradient_checkpointing_kwargs"] == {"use_reentrant": False}
    assert checkpointing_of(OldArguments(**{k: old[k] for k in ("gradient_checkpointing", "gradient_checkpointing_kwargs")})) \
        == (True, {"use_reentrant": False})
    every = hf_plan(quick("bf16", checkpointing="every:2"), "cpu").training_args
    with pytest.raises(ConfigError, match="checkpoints every layer or none.*--checkpointing full"):
        _checkpointing_for_installed(dict(every), OldArguments)
    assert _checkpointing_for_installed(dict(every), transformers.TrainingArguments) == every  # the installed one has both

    class OldModel:  # an older PreTrainedModel: gradient_checkpointing_enable only
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            self.kwargs = gradient_checkpointing_kwargs

    model = OldModel()
    enable_checkpointing(model, {"use_reentrant": False})
    assert model.kwargs == {"use_reentrant": False}


def test_rows_run_the_trainers_low_bit_block_and_adafactor_step():
    """The Trainer's torchao block is fixed at 256: a low-bit row runs memtrain with it too
    (unless --set optim_block says otherwise, which the plan then reports); Adafactor takes
    --lr as its step on both sides, and the relative step has no Trainer equivalent."""
    rows = {r["preset"]: r for r in resolve_rows("quick", ["lowest-memory", "adamw-8bit", "baseline"],
                                                            {"progress": False}, "cpu")}
    assert rows["lowest-memory"]["config"].technique.optim_block == TRAINER_LOW_BIT_BLOCK
    assert rows["adamw-8bit"]["config"].technique.optim_block == TRAINER_LOW_BIT_BLOCK
    assert rows["baseline"]["config"].technique.optim_block == 0
    assert any("on both sides" in m for m in rows["lowest-memory"]["plan"].mapping)
    own = resolve_rows("quick", ["lowest-memory"], {"progress": False, "optim_block": 128}, "cpu")[0]
    assert own["config"].technique.optim_block == 128
    assert any("--optim-block 128" in m for m in own["plan"].missing)
    assert hf_plan(quick("adafactor", adafactor_relative_step=True), "cpu").status == "none"


def test_default_model_has_the_same_parameter_count():
    cfg = build_config({})
    with torch.device("meta"):
        hf = build_hf_model(cfg, hf_plan(cfg, "cpu"), init_from_memtrain=False)
        ours = GPT(cfg.model)
    assert hf.num_parameters() == ours.num_parameters() == 16_156_416
    assert hf.lm_head.weight is hf.transformer.wte.weight


def test_hf_model_is_built_on_the_device_it_is_given():
    """The Trainer side is built where it trains (meta stands in for a GPU), as memtrain's side
    is: same generator, same initial weights, no FP32 copy on the host first."""
    cfg = build_config(TINY)
    hf = build_hf_model(cfg, hf_plan(cfg, "cpu"), init_from_memtrain=False, device=torch.device("meta"))
    assert {p.device.type for p in hf.parameters()} == {"meta"}
    assert torch.get_default_dtype() == torch.float32  # the build's default dtype is put back


def test_bf16_pure_lora_row_runs_the_trainer_on_a_bf16_model():
    """A LoRA row under bf16-pure compares against the Trainer + peft recipe (the model in BF16,
    bf16=True), starting from our GPT's BF16 weights; full fine-tuning in bf16-pure has none."""
    from memtrain.training.step import building_on

    cfg = build_config(TINY, {"precision": "bf16-pure", "lora_rank": 4})
    plan = hf_plan(cfg, "cpu")
    assert plan.status == "closest" and plan.weight_dtype == "bfloat16" and plan.training_args["bf16"] is True
    assert any("FP32 as well" in m for m in plan.missing)  # our GPT's adapters are FP32 too
    assert hf_plan(build_config(TINY, {"precision": "bf16-pure"}), "cpu").status == "none"
    hf = build_hf_model(cfg, plan)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    seed_everything(cfg.train.seed)
    with building_on(torch.device("cpu"), torch.bfloat16):
        ours = GPT(cfg.model)  # what memtrain's side builds under bf16-pure
    x = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours(x), atol=0, rtol=0)


# ----------------------------------------------------------------------------- same model
@pytest.mark.parametrize("overrides", [{"attention": "math"}, {"attention": "sdpa"}, {"untie_embeddings": True}])
def test_hf_model_starts_from_memtrains_weights(overrides):
    cfg = build_config(TINY, overrides)
    plan = hf_plan(cfg, "cpu")
    hf = build_hf_model(cfg, plan)
    seed_everything(cfg.train.seed)
    ours = GPT(cfg.model)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 512, (2, 16), generator=g)
    y = torch.randint(0, 512, (2, 16), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, ours(x), atol=1e-5, rtol=1e-5)
        same = hf(input_ids=x, labels=y, shift_labels=y).loss
        shifted = hf(input_ids=x, labels=y).loss  # HF's own shift drops the last target of each row
        assert float(same) == pytest.approx(float(ours(x, y)), abs=1e-5)
        assert abs(float(shifted) - float(same)) > 1e-4


def test_dataset_reproduces_memtrains_batches():
    from transformers import default_data_collator

    from memtrain.data import make_train_loader

    tokens = np.arange(5000, dtype=np.uint16) % 997
    cfg = build_config(TINY, {"steps": 5})
    ds = hf_train_dataset(tokens, cfg)
    assert len(ds) == 5 * cfg.train.batch_size
    loader = make_train_loader(tokens, cfg.train.seq_len, cfg.train.batch_size, seed=cfg.train.seed)
    for step in range(5):
        x, y = loader.next_batch()
        b = cfg.train.batch_size
        batch = default_data_collator([ds[i] for i in range(step * b, (step + 1) * b)])
        assert torch.equal(batch["input_ids"], x)
        assert torch.equal(batch["shift_labels"], y)


@pytest.mark.parametrize("schedule", [{}, {"schedule": "linear", "min_lr_ratio": 0.0}])
def test_schedule_is_memtrains_up_to_hfs_one_step_warmup_offset(schedule):
    from transformers import get_scheduler

    from memtrain.training.step import lr_lambda

    cfg = build_config(TINY, {"steps": 20, "warmup_steps": 5, **schedule})
    plan = hf_plan(cfg, "cpu")
    model = torch.nn.Linear(2, 2)
    args = training_arguments(cfg, plan, "/tmp/unused", torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = get_scheduler(args.lr_scheduler_type, optimizer=opt, num_warmup_steps=args.warmup_steps,
                          num_training_steps=args.max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    hf = [sched.lr_lambdas[0](s) for s in range(20)]
    ours = [lr_lambda(cfg)(s) for s in range(20)]
    assert hf[:5] == pytest.approx([0.0] + ours[:4])  # HF: s / W, memtrain: (s + 1) / W
    assert hf[5:] == pytest.approx(ours[5:])
    assert ours[-1] > cfg.train.min_lr_ratio  # still decaying towards the same floor
    assert sched.lr_lambdas[0](20) == pytest.approx(cfg.train.min_lr_ratio)


def test_the_trainer_gets_every_loop_setting_of_the_run():
    """The Trainer side runs memtrain's loop: each setting lands in its TrainingArguments field
    (values unlike the defaults, so a field left at its default or read from another setting shows)."""
    cfg = build_config(TINY, {"steps": 17, "warmup_steps": 3, "batch_size": 3, "grad_accum": 2, "lr": 2e-3,
                              "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.97, "grad_clip": 0.7, "seed": 11,
                              "min_lr_ratio": 0.2})
    args = training_arguments(cfg, hf_plan(cfg, "cpu"), "/tmp/unused", torch.device("cpu"))
    assert (args.max_steps, args.warmup_steps, args.per_device_train_batch_size, args.gradient_accumulation_steps) \
        == (17, 3, 3, 2)
    assert (args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2, args.max_grad_norm, args.seed) \
        == (2e-3, 0.05, 0.8, 0.97, 0.7, 11)
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.2}
    constant = build_config(TINY, {"schedule": "constant", "warmup_steps": 2, "steps": 9})
    args = training_arguments(constant, hf_plan(constant, "cpu"), "/tmp/unused", torch.device("cpu"))
    assert getattr(args.lr_scheduler_type, "value", None) == "constant_with_warmup" and args.warmup_steps == 2


def test_trainer_optimizer_decays_the_same_tensors():
    from memtrain.techniques.optim import param_groups

    cfg = build_config(TINY)
    plan = hf_plan(cfg, "cpu")
    hf = build_hf_model(cfg, plan)
    args = training_arguments(cfg, plan, "/tmp/unused", torch.device("cpu"))
    opt = make_hf_optimizer(hf, args)
    assert type(opt) is torch.optim.AdamW and opt.defaults["betas"] == (0.9, 0.95)
    ours = param_groups(GPT(cfg.model), cfg.train.weight_decay)
    numel = lambda group: sum(p.numel() for p in group["params"])  # noqa: E731
    assert [numel(g) for g in opt.param_groups] == [numel(g) for g in ours]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


# ----------------------------------------------------------------------------- meters
def test_traced_hf_probe_equals_the_real_step():
    cfg = build_config(TINY)
    traced = hf_step_peak(cfg, 2, fake=True)
    real = hf_step_peak(cfg, 2, fake=False)
    assert traced == real
    assert hf_step_peak(cfg, 4, fake=True) > traced  # grows with the batch


def test_trainer_run_is_metered_like_memtrain(small_corpus):
    from memtrain.training.train import train

    cfg = build_config({**TINY, "vocab_size": 50257, "max_seq_len": 32, "d_model": 32, "d_ff": 64},
                       {"data": str(small_corpus), "steps": 4, "warmup_steps": 2, "val_blocks": 4,
                        "warmup_timing_steps": 1})
    theirs = run_theirs(cfg)
    ours = train(cfg, progress=False)
    mem = theirs["memory"]
    assert mem["peak_bytes"] == sum(mem["by_category"].values()) > 0
    assert mem["by_category"]["optimizer"] == ours["memory"]["by_category"]["optimizer"] > 0
    assert mem["peak_phase"] in ("forward", "backward", "optimizer")
    assert theirs["timed_steps"] == 4 - 2  # the two metered steps are left out, as in memtrain
    assert theirs["parameters"] == ours["parameters"]
    # Same weights, same first batch: the same first loss (the schedules differ from step 1 on).
    assert theirs["loss_history"][0] == pytest.approx(ours["loss_history"][0], abs=1e-4)
    assert math.isfinite(theirs["val_ppl"])


# ----------------------------------------------------------------------------- report
def _fake_run(preset, side, rep, h, step, peak, ppl=100.0, mb=8):
    return {"preset": preset, "side": side, "rep": rep, "position": 1, "config_hash": h, "result": {
        "status": "ok", "step_time_s": {"median": step, "p10": step, "p90": step, "mean": step},
        "memory": {"peak_bytes": peak, "by_category": {"parameters": peak}, "peak_phase": "backward"},
        "val_ppl": ppl, "train_loss": 5.0, "parameters": 10, "trainable_parameters": 10,
        "max_batch": {"batch_size": mb, "peak_bytes": peak, "probes": [{"batch_size": 4, "peak_bytes": peak}]}}}


def test_aggregate_ratios_and_markdown():
    rows = resolve_rows("quick", ["baseline", "window-flash"], {"progress": False}, "cpu")
    h = config_hash(rows[0]["config"])
    runs = [_fake_run("baseline", "ours", 0, h, 1.0, 100), _fake_run("baseline", "theirs", 0, h, 2.0, 200, mb=4),
            _fake_run("baseline", "ours", 1, h, 3.0, 100), _fake_run("baseline", "theirs", 1, h, 2.0, 200, mb=4)]
    table = aggregate(rows, runs)
    r = table[0]["ratios"]
    assert r["peak_bytes"] == 0.5 and r["max_batch"] == 2.0
    assert r["step_time_s"] == pytest.approx(2.0 / 2.0)
    assert table[0]["paired_step_ratios"] == [0.5, 1.5]
    assert table[1]["hf_status"] == "none"
    md = render_markdown({"env": {"commit": "abc"}, "settings": {
        "scale": "quick", "batch_size": 4, "seq_len": 128, "steps": 8, "warmup_steps": 3, "grad_accum": 1,
        "dropout": 0.0, "repeats": 2, "budget": "1GiB", "max_batch": 256, "maxbatch_method": "trace"},
        "command": "python benchmarks/compare_hf.py", "finished": "now", "wall_s": 60, "rows": table, "runs": runs})
    assert "| window-flash | no HF equivalent |" in md
    assert "| baseline | 0.50 | 1.00 | 0.50, 1.50 |" in md
    assert "- **baseline** (matched; attention `math`, attn_implementation `eager`, " in md  # named as run
    assert table[0]["step_overlap_s"] == [0.0, 0.0]
    # The PPL column compares the two learning-rate schedules unless the Trainer is given memtrain's.
    schedules = "the PPL ratio mostly compares the schedules; --exact-schedule gives the Trainer memtrain's"
    assert schedules in md
    exact = {"env": {"commit": "abc"}, "settings": {
        "scale": "quick", "batch_size": 4, "seq_len": 128, "steps": 8, "warmup_steps": 3, "grad_accum": 1,
        "dropout": 0.0, "repeats": 2, "exact_schedule": True},
        "command": "c", "finished": "now", "wall_s": 60, "rows": table, "runs": runs}
    md_exact = render_markdown(exact)
    assert schedules not in md_exact and "HF given memtrain's LR schedule (--exact-schedule)" in md_exact


def _gemma2_dir(tmp_path):
    d = tmp_path / "gemma2"
    transformers.Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16).save_pretrained(d)
    return d


@pytest.mark.parametrize("model, attention, implementation", [
    ("tiny-llama", "sdpa", "sdpa"),  # what HF Trainer and `memtrain bench` build a Llama with
    ("gemma2", "math", "eager"),  # a family without SDPA: eager, as transformers builds it
])
def test_a_row_naming_no_attention_runs_the_models_default_on_both_sides(tmp_path, model, attention, implementation):
    """A compare_hf row that names no attention ran eager on both sides, while the same row under
    `memtrain bench` (and the Trainer unasked) runs the model's default: it takes that default
    now, in the config memtrain trains and in the plan the Trainer runs, and the report names it."""
    spec = str(_gemma2_dir(tmp_path)) if model == "gemma2" else model
    overrides = {"progress": False, "model": spec}
    rows = resolve_rows("quick", ["precision=fp32", "precision=fp32+attention=math"], overrides, "cpu")
    default, asked = rows
    assert default["config"].technique.attention == attention
    assert default["plan"].attn_implementation == implementation
    assert asked["config"].technique.attention == "math" and asked["plan"].attn_implementation == "eager"
    bench_opts = bench_runner.BenchOptions(techniques=["precision=fp32"], scale="quick", overrides=overrides)
    (_, bench_cfg), = bench_runner.resolve_rows(bench_opts)
    assert bench_cfg.technique.attention == default["config"].technique.attention
    entry = aggregate(rows[:1], [])[0]
    assert entry["attention"] == attention and entry["hf_attn_implementation"] == implementation


def test_cli_rejects_an_unknown_preset(capsys):
    assert main(["--presets", "nope", "--out", "/tmp/compare-hf-unused"]) == 2
    assert capsys.readouterr().err.startswith("error: preset 'nope'")


def test_report_only_rebuilds_the_tables(tmp_path):
    import json

    rows = resolve_rows("quick", ["baseline"], {"progress": False, "device": "auto"}, "cpu")
    h = config_hash(rows[0]["config"])
    runs = [_fake_run("baseline", "ours", 0, h, 1.0, 100), _fake_run("baseline", "theirs", 0, h, 2.0, 200)]
    (tmp_path / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in runs))
    assert main(["--presets", "baseline", "--out", str(tmp_path), "--report-only"]) == 0
    report = json.loads((tmp_path / REPORT_JSON).read_text())
    assert report["rows"][0]["ratios"]["peak_bytes"] == 0.5
    assert "| baseline | matched | 0.0 | 0.0 |" in (tmp_path / REPORT_MD).read_text()  # 100 and 200 bytes in MiB


@pytest.mark.parametrize("edit", ["no-result", "result-text", "rep-text", "side-list", "step-text", "memory-list",
                                  "peak-text", "ppl-text", "max-batch-text", "status-number"])
def test_report_only_skips_a_runs_line_of_the_wrong_shape_with_a_warning(tmp_path, capsys, edit):
    """A hand-edited or foreign runs.jsonl line that parses as JSON (no result, a text where a
    number belongs, a list where an object does) ended --report-only and --resume with a KeyError
    or TypeError traceback; it is skipped and counted in one warning, the report built from the rest."""
    import copy
    import json

    rows = resolve_rows("quick", ["baseline"], {"progress": False, "device": "auto"}, "cpu")
    h = config_hash(rows[0]["config"])
    runs = [_fake_run("baseline", "ours", 0, h, 1.0, 100), _fake_run("baseline", "theirs", 0, h, 2.0, 200)]
    bad = copy.deepcopy(runs[0])
    res = bad["result"]
    {"no-result": lambda: bad.pop("result"), "result-text": lambda: bad.update(result="x"),
     "rep-text": lambda: bad.update(rep="zero"), "side-list": lambda: bad.update(side=["ours"]),
     "step-text": lambda: res.update(step_time_s="fast"), "memory-list": lambda: res.update(memory=[1]),
     "peak-text": lambda: res["memory"].update(peak_bytes="big"), "ppl-text": lambda: res.update(val_ppl="x"),
     "max-batch-text": lambda: res.update(max_batch="x"), "status-number": lambda: res.update(status=3)}[edit]()
    (tmp_path / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in [*runs, bad]))
    assert main(["--presets", "baseline", "--out", str(tmp_path), "--report-only"]) == 0
    assert "warning: skipped 1 unreadable line(s)" in capsys.readouterr().err
    assert json.loads((tmp_path / REPORT_JSON).read_text())["rows"][0]["ratios"]["peak_bytes"] == 0.5


def test_report_only_on_a_folder_without_a_run_is_refused_and_writes_nothing(tmp_path, capsys):
    """--report-only on a folder another tool wrote (a runs.jsonl of other lines) wrote a report
    of rows all "not run", stamped with this machine and the time now, and exited 0: it looked
    like a finished comparison. Refused in one line, nothing written; a folder not there is not
    made either."""
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / RUNS_FILE).write_text('{"model": "x", "acc": 0.5}\n[1]\n')
    (foreign / "report.md").write_text("theirs\n")
    assert main(["--presets", "baseline", "--out", str(foreign), "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "holds no run (2 unreadable line(s) skipped)" in err[0]
    assert sorted(p.name for p in foreign.iterdir()) == ["report.md", RUNS_FILE]
    assert main(["--presets", "baseline", "--out", str(tmp_path / "new"), "--report-only"]) == 2
    assert "not found; run the comparison first" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_used_folder_a_link_or_a_file_as_out_is_refused_and_nothing_is_deleted(tmp_path, capsys):
    """A second comparison into a folder with runs.jsonl would have deleted it (the default --out
    was a committed results folder): refused in one line unless --resume or --report-only."""
    used = tmp_path / "used"
    used.mkdir()
    (used / RUNS_FILE).write_text('{"preset": "earlier"}\n')
    (used / "commands.log").write_text("earlier command\n")
    (tmp_path / "file").write_text("keep")
    (tmp_path / "link").symlink_to(used, target_is_directory=True)
    for out, words in ((used, f"already holds {RUNS_FILE} of an earlier comparison"), (tmp_path / "file", "is a file"),
                       (tmp_path / "link", "symbolic link")):
        assert main(["--presets", "baseline", "--no-maxbatch", "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert (used / RUNS_FILE).read_text() == '{"preset": "earlier"}\n'
    assert (used / "commands.log").read_text() == "earlier command\n"
    assert sorted(p.name for p in used.iterdir()) == ["commands.log", RUNS_FILE]


def test_a_planted_link_under_a_name_the_report_writes_is_refused_before_anything_is_written(tmp_path, capsys):
    import json

    rows = resolve_rows("quick", ["baseline"], {"progress": False, "device": "auto"}, "cpu")
    h = config_hash(rows[0]["config"])
    runs = [_fake_run("baseline", "ours", 0, h, 1.0, 100), _fake_run("baseline", "theirs", 0, h, 2.0, 200)]
    (tmp_path / RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in runs))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / REPORT_MD).symlink_to(victim)
    assert main(["--presets", "baseline", "--out", str(tmp_path), "--report-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{REPORT_MD} is a symbolic link" in err[0], err
    assert victim.read_text() == "precious\n" and not (tmp_path / REPORT_JSON).exists()


def test_ctrl_c_keeps_the_finished_runs_writes_the_report_and_exits_130(tmp_path, monkeypatch, capsys):
    import memtrain.bench.hf.cli as cli

    def interrupted(opts, out, rows, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_rows", interrupted)
    assert main(["--presets", "baseline", "--no-maxbatch", "--out", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("interrupted: the runs that finished are in") and "--resume" in err[-1]
    assert (tmp_path / REPORT_MD).is_file() and (tmp_path / "commands.log").read_text().count("started") == 1


def test_a_second_comparison_on_a_busy_folder_is_refused_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """Two `--resume` runs on one folder each ran the rows neither had recorded and appended
    each row twice to runs.jsonl. The second is refused (exit 2, naming the holder) before it
    reads runs.jsonl or runs a row; once the first has ended, the folder is free."""
    import os

    import memtrain.bench.hf.cli as cli
    from memtrain.files.lock import FolderLock

    ran = []
    monkeypatch.setattr(cli, "run_rows", lambda *a, **k: ran.append(a))
    argv = ["--presets", "baseline", "--no-maxbatch", "--out", str(tmp_path), "--resume"]
    with FolderLock(tmp_path, "compare_hf"):  # the first comparison, still running
        assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and str(os.getpid()) in err[0], err
    assert not ran and not (tmp_path / "commands.log").exists()
    assert main(argv) != 2 and len(ran) == 1  # the rows ran (stubbed: the report has none, exit 1)


def test_sigterm_is_ctrl_c_the_report_is_written_and_the_exit_is_130(tmp_path):
    """A scheduler's SIGTERM ended the comparison by the signal's default action: no report of the
    runs already recorded, exit -15. It now stops like Ctrl-C."""
    import subprocess
    import sys

    code = ("import os, signal, sys, time\n"
            "import memtrain.bench.hf.cli as cli\n"
            "cli.run_rows = lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30))\n"
            f"sys.exit(cli.main(['--presets', 'baseline', '--no-maxbatch', '--out', {str(tmp_path)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("interrupted: the runs that finished are in")
    assert (tmp_path / REPORT_MD).is_file()


def test_ctrl_c_while_a_pair_runs_kills_both_workers(monkeypatch):
    import os
    import subprocess
    import sys

    import memtrain.bench.hf.lockstep as lockstep

    procs = {side: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for side in ("ours", "theirs")}
    inbox = {side: os.pipe() for side in procs}

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(lockstep.time, "sleep", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            lockstep._wait_for_pair(procs, inbox, 0.0, None)
        assert all(p.poll() is not None for p in procs.values())  # none runs on alone
    finally:
        for p in procs.values():
            p.kill()
        for r, w in inbox.values():
            os.close(r)
            os.close(w)


# ----------------------------------------------------------------------------- lockstep
def test_baton_alternates_two_sides():
    import os
    import threading

    a_in, b_out = os.pipe()
    b_in, a_out = os.pipe()
    a, b = Baton(f"{a_in},{a_out}"), Baton(f"{b_in},{b_out}")
    order: list[str] = []

    def side(name, baton, steps):
        baton.acquire()
        for _ in range(steps):
            order.append(name)
            baton.handoff()
        baton.finish()

    os.write(b_out, b"g")  # a takes the first turn
    threads = [threading.Thread(target=side, args=("a", a, 3)), threading.Thread(target=side, args=("b", b, 5))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert "".join(order) == "ababab" + "bb"  # strict turns, then b runs freely once a is done
    assert Baton(None).free


@pytest.mark.slow  # two processes stepping in lockstep, ~20 s: runs with `-m slow`
def test_lockstep_pair_never_overlaps_steps(small_corpus):
    cfg = build_config({**TINY, "vocab_size": 50257, "d_model": 32, "d_ff": 64},
                       {"data": str(small_corpus), "steps": 4, "warmup_steps": 1, "val_blocks": 2,
                        "warmup_timing_steps": 1})
    results = run_pair(("theirs", "ours"), cfg, None, None, 300)
    assert {r["status"] for r in results.values()} == {"ok"}, results
    ours, theirs = results["ours"]["step_windows"], results["theirs"]["step_windows"]
    assert len(ours) == len(theirs) == 4
    assert window_overlap_s(ours, theirs) == 0.0
    timeline = sorted([(s, "o") for s, _ in ours] + [(s, "t") for s, _ in theirs])
    assert "".join(side for _, side in timeline) == "totototo"


@pytest.mark.slow  # times every phase of a profiled step: runs with `-m slow`
def test_profile_phases_times_every_phase():
    cfg = build_config(TINY, {"steps": 4})
    result = profile_phases(cfg, steps=2, top_ops=3)
    for side in ("ours", "theirs"):
        assert all(result[side][k] > 0 for k in ("forward", "backward", "optimizer"))
        assert result[side]["step"] >= result[side]["forward"]
        assert "aten::" in result[side]["top_ops"]
        ops = result[side]["ops"]  # every operator's calls and self time per profiled step
        assert ops["aten::mm"]["count"] > 0 and ops["aten::mm"]["self_ms"] > 0
    # memtrain's GPT has no host sync in forward or backward; the Trainer's (GPT-2 in transformers)
    # is counted too: at most one, in transformers' causal-mask builder (5.24 reads the position ids)
    assert result["ours"]["host_syncs"] == {"count": 0, "sites": "none"}
    assert result["theirs"]["host_syncs"]["count"] in (0, 1), result["theirs"]["host_syncs"]


def _profile(forward: float, backward: float, ops: dict[str, tuple[float, float]]) -> dict:
    return {"forward": forward, "backward": backward, "optimizer": 0.01, "step": forward + backward + 0.01,
            "ops": {op: {"count": n, "self_ms": ms} for op, (n, ms) in ops.items()}}


def test_checkpointing_cost_names_what_one_side_adds_and_the_other_does_not():
    """profile.md's "What checkpointing adds" section (the GPU runbook's hf-qwen05-ckpt-profile):
    each side's row with checkpointing less its row without; an operator that one side's recompute
    runs more often is listed with both counts, and the added device time by operator."""
    plain = {"ours": _profile(0.030, 0.060, {"aten::mm": (10, 5.0), "aten::copy_": (4, 0.5)}),
             "theirs": _profile(0.031, 0.061, {"aten::mm": (10, 5.0), "aten::copy_": (4, 0.5)})}
    ckpt = {"ours": _profile(0.031, 0.100, {"aten::mm": (14, 7.0), "aten::copy_": (8, 1.5)}),
            "theirs": _profile(0.032, 0.090, {"aten::mm": (14, 7.0), "aten::copy_": (6, 1.0)})}
    text = "\n".join(checkpointing_cost_lines(plain, ckpt, "CUDA"))
    assert "| ours | +1.0 | +40.0 | +0.0 | +41.0 | +8 |" in text
    assert "| theirs | +1.0 | +29.0 | +0.0 | +30.0 | +6 |" in text
    assert "| `aten::copy_` | +4.0 | +2.0 |" in text  # ours copies twice as often: named
    assert "`aten::mm` | +4.0" not in text.split("Most added")[0]  # the same on both sides: not listed
    assert "| `aten::mm` | +2.00 | +2.00 |" in text.split("Most added")[1]
    # the same recompute on both sides: said in words
    same = "\n".join(checkpointing_cost_lines(plain, {**ckpt, "theirs": ckpt["ours"]}, "CPU"))
    assert "none: each side adds the same calls" in same and "self CPU time" in same


def test_a_checkpointed_row_is_paired_with_the_same_row_without_checkpointing():
    from memtrain.bench.hf.report import _plain_twin

    rows = [{"preset": p, "config": build_config(TINY, {"precision": "bf16", **tech})} for p, tech in
            (("ckpt", {"checkpointing": "full"}), ("chunked", {"loss": "chunked"}), ("plain", {}))]
    assert _plain_twin(rows[0], rows) is rows[2]
    assert _plain_twin(rows[2], rows) is None  # no checkpointing: nothing to subtract
    assert _plain_twin(rows[0], rows[:2]) is None  # no plain twin profiled: no section


def test_profile_phases_builds_our_model_on_the_device_in_its_weight_dtype(monkeypatch):
    """memtrain's side of the profile is built as train builds it (memtrain.training.step.build_base_model):
    on the run's device in the weight dtype, not in FP32 on the host and then moved."""
    import memtrain.models
    import memtrain.training.step as step_mod

    class Built(Exception):
        """Stops the profile once the model is built: what follows is not under test."""

    seen: list[tuple[str, torch.dtype]] = []

    def spy(where):
        def build(cfg):
            seen.append((where, torch.get_default_dtype()))
            raise Built

        return build

    monkeypatch.setattr(step_mod, "build_model", spy("build_base_model"))
    monkeypatch.setattr(memtrain.models, "build_model", spy("bare build_model"))
    with pytest.raises(Built):
        profile_phases(build_config(TINY, {"steps": 2, "precision": "bf16-pure"}), steps=1, top_ops=1)
    assert seen == [("build_base_model", torch.bfloat16)]


def test_a_floored_linear_schedule_is_refused_as_the_trainer_has_no_twin(tmp_path, capsys):
    """The Trainer's ``linear`` decays to 0: a memtrain linear schedule with the default
    --min-lr-ratio 0.1 was run beside it as "the same schedule", the two sides at different rates
    after the warm-up. It is one error line, before any row runs; ratio 0 or --exact-schedule runs."""
    from memtrain.bench.hf.cli import parse_args, resolve

    base = ["--steps", "4", "--techniques", "baseline", "--no-maxbatch", "--set", "schedule=linear"]
    out = tmp_path / "cmp"
    assert main([*base, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "min_lr_ratio=0" in err and "--exact-schedule" in err, err
    assert not (out / RUNS_FILE).exists()
    for more in (["--set", "min_lr_ratio=0"], ["--exact-schedule"]):
        rows, _, _ = resolve(parse_args([*base, *more]))
        assert rows[0]["config"].train.schedule == "linear"
