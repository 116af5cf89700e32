"""The HF comparison on a transformers model (``benchmarks/compare_hf.py --model SPEC``): the
Trainer side trains the very model memtrain trains (same config edits, same initial weights,
same tokens), with peft's LoRA where memtrain injects the same LoraConfig."""

from __future__ import annotations

import importlib.machinery
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from memtrain.bench.hf import cli, mapping, probe, rows  # noqa: E402
from memtrain.bench.hf.memtrain_side import warm_device_facts  # noqa: E402
from memtrain.bench.hf.trainer_side import run_theirs  # noqa: E402
from memtrain.config.run import build_config  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet_one_thread():
    transformers.logging.set_verbosity_error()
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a shared 2-core machine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(n)




def _cfg(model_dir: Path, corpus: Path, **kw):
    base = {"model": str(model_dir), "data": str(corpus), "batch_size": 2, "seq_len": 16, "steps": 3,
            "warmup_steps": 1, "val_blocks": 2, "warmup_timing_steps": 1, "progress": False,
            "attention": "sdpa", "device": "cpu"}
    return build_config({**base, **kw})


def test_plan_for_a_transformers_model(llama_dir):
    base = mapping.hf_plan(build_config({"model": str(llama_dir), "attention": "math", "seq_len": 16}), "cpu")
    assert base.status == "matched" and base.attn_implementation == "eager"
    assert any("same AutoModelForCausalLM" in m for m in base.mapping)
    lora = mapping.hf_plan(build_config({"model": str(llama_dir), "lora_rank": 4, "seq_len": 16}), "cpu")
    assert lora.lora is not None and lora.lora["target_modules"] == "all-linear"  # memtrain's default for HF models
    assert "fan_in_fan_out" not in lora.lora
    window = mapping.hf_plan(build_config({"model": str(llama_dir), "window": 8, "seq_len": 16}), "cpu")
    assert window.status == "none" and "sliding-window" in window.missing[0]  # Llama has none
    assert mapping.hf_plan(build_config({"model": "mistral-7b", "window": 64, "seq_len": 128}), "cpu").status == "matched"
    pure = {"model": str(llama_dir), "precision": "bf16-pure", "seq_len": 16}
    assert mapping.hf_plan(build_config(pure), "cpu").status == "none"  # full fine-tuning: no FP32-less Trainer mode
    assert mapping.hf_plan(build_config({**pure, "lora_rank": 4}), "cpu").status == "closest"


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_trainer_trains_the_same_transformers_model(llama_dir, small_corpus, lora_rank):
    """Same parameters, same first loss (same weights and first batch), same tracked peak
    category for the optimizer state; LoRA: the same adapters trainable on both sides."""
    from memtrain.training.train import train

    cfg = _cfg(llama_dir, small_corpus, lora_rank=lora_rank)
    warm_device_facts(cfg)
    theirs = run_theirs(cfg)
    ours = train(cfg, progress=False)
    assert theirs["parameters"] == ours["parameters"]
    assert theirs["trainable_parameters"] == ours["trainable_parameters"]
    assert (theirs["trainable_parameters"] < theirs["parameters"]) == bool(lora_rank)
    assert theirs["loss_history"][0] == pytest.approx(ours["loss_history"][0], abs=1e-5)
    assert theirs["memory"]["by_category"]["optimizer"] == ours["memory"]["by_category"]["optimizer"] > 0
    assert theirs["timed_steps"] == 1  # steps 0 and 1 metered, left out of the timing as in memtrain


def test_qlora_plan_loads_through_bitsandbytes_or_says_it_is_missing(llama_dir, monkeypatch):
    """QLoRA's Trainer side is the bitsandbytes 4-bit loader; without bitsandbytes, or on our
    GPT, the row has no Trainer side and says why."""
    row = {"model": str(llama_dir), "lora_rank": 4, "qlora": True, "precision": "bf16-pure", "seq_len": 16}
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as when it is not installed
    missing = mapping.hf_plan(build_config(row), "cuda")
    assert missing.status == "none" and "pip install bitsandbytes" in missing.missing[0]
    stand_in = types.ModuleType("bitsandbytes")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)  # installed, as find_spec sees it
    monkeypatch.setitem(sys.modules, "bitsandbytes", stand_in)
    plan = mapping.hf_plan(build_config(row), "cuda")
    assert plan.status == "closest" and plan.weight_dtype == "bfloat16"  # only the adapters' dtype differs on CUDA
    assert plan.quantization == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                                 "bnb_4bit_compute_dtype": "bfloat16"}
    assert any("torchao's NF4" in m for m in mapping.hf_plan(build_config(row), "cpu").missing)
    gpt = {k: v for k, v in row.items() if k != "model"}
    assert mapping.hf_plan(build_config(gpt), "cuda").status == "none"


def test_qlora_trainer_side_trains_a_bitsandbytes_4bit_base(small_corpus):
    """The Trainer side of a QLoRA row loads memtrain's initial weights through bitsandbytes'
    4-bit loader (Linear4bit), with the same trainable adapters as memtrain's side. (The bundled
    tiny-llama: bitsandbytes' CPU inference kernel needs widths that divide its blocks.)"""
    bnb = pytest.importorskip("bitsandbytes")
    from memtrain.training.train import train

    cfg = _cfg("tiny-llama", small_corpus, lora_rank=4, qlora=True, precision="bf16-pure")
    plan = mapping.hf_plan(cfg, "cpu")
    from memtrain.bench.hf.hf_model import build_hf_model

    model = build_hf_model(cfg, plan)
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 7 * model.config.num_hidden_layers  # q, k, v, o, gate, up, down
    del model
    warm_device_facts(cfg)
    theirs = run_theirs(cfg)
    ours = train(cfg, progress=False)
    assert theirs["hf_plan"]["quantization"]["load_in_4bit"] is True
    assert theirs["trainable_parameters"] == ours["trainable_parameters"]
    # the same BF16 weights quantized to NF4 by two libraries: close first losses, not equal ones
    assert theirs["loss_history"][0] == pytest.approx(ours["loss_history"][0], rel=5e-2)


def test_bf16_pure_lora_row_trains_the_same_bf16_model(llama_dir, small_corpus):
    """bf16-pure + LoRA on a transformers model: the Trainer side trains the same BF16 base (same
    first loss up to autocast's FP32 islands) with peft's FP32 adapters, memtrain's are BF16."""
    from memtrain.training.train import train

    cfg = _cfg(llama_dir, small_corpus, lora_rank=4, precision="bf16-pure")
    plan = mapping.hf_plan(cfg, "cpu")
    assert plan.status == "closest" and any("stochastically rounded" in m for m in plan.missing)
    warm_device_facts(cfg)
    theirs = run_theirs(cfg)
    ours = train(cfg, progress=False)
    assert theirs["hf_plan"]["weight_dtype"] == "bfloat16"
    assert theirs["trainable_parameters"] == ours["trainable_parameters"] < ours["parameters"]
    assert theirs["loss_history"][0] == pytest.approx(ours["loss_history"][0], rel=2e-2)
    # The one difference is the adapters: FP32 with FP32 AdamW moments on the Trainer side (two
    # more bytes per adapter weight, 8 bytes of state), BF16 with BF16 moments on ours.
    n = ours["trainable_parameters"]
    mine, hers = ours["memory"]["by_category"], theirs["memory"]["by_category"]
    assert 2 * n <= hers["parameters"] - mine["parameters"] <= 2 * n + 64
    assert hers["optimizer"] >= 8 * n > mine["optimizer"] >= 4 * n


def test_traced_trainer_probe_equals_the_real_step_on_a_transformers_model(llama_dir):
    cfg = build_config({"model": str(llama_dir), "seq_len": 16, "attention": "sdpa", "lora_rank": 4})
    traced = probe.hf_step_peak(cfg, 2, fake=True)
    assert traced == probe.hf_step_peak(cfg, 2, fake=False)
    assert probe.hf_step_peak(cfg, 4, fake=True) > traced


def test_cli_names_rows_like_the_bench(llama_dir):
    """--techniques is the bench's name for the rows (--presets kept); --model reaches every row."""
    assert cli.parse_args(["--presets", "bf16"]).techniques == cli.parse_args(["--techniques", "bf16"]).techniques
    opts = cli.parse_args(["--model", str(llama_dir), "--techniques", "baseline,lora", "--no-maxbatch",
                           "--set", "seq_len=16"])
    resolved, maxbatch, _ = cli.resolve(opts)
    assert maxbatch is None
    assert [r["config"].model.model for r in resolved] == [str(llama_dir)] * 2
    assert cli.settings_of(opts, resolved, maxbatch, None)["model"] == str(llama_dir)
    assert rows.config_hash(resolved[0]["config"]) != rows.config_hash(resolved[1]["config"])
