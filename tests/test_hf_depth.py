"""A deep transformers model traced from two shallow copies (memtrain.analysis.depth_trace): the
extrapolated step equals the full trace to the byte, category by category."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from memtrain.config.run import build_config  # noqa: E402
from tiny_families import tiny_config  # noqa: E402

# The families traced here, and what each sets beyond its tiny config: Mistral a window of 16,
# shorter than the steps' 32 tokens, so the traced step is the windowed one.
FAMILIES = {"llama": {}, "qwen2": {}, "mistral": {"sliding_window": 16}, "gemma": {}, "gpt2": {}}


# Tiny models: one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def _model_dir(root: Path, family: str, n_layers: int, **overrides) -> Path:
    d = root / f"{family}-{n_layers}"
    d.mkdir(parents=True, exist_ok=True)
    tiny_config(family, n_layers, **{**FAMILIES[family], **overrides}).save_pretrained(d)
    return d


def _cfg(model_dir: Path, **tech):
    return build_config({"model": str(model_dir), "batch_size": 2, "seq_len": 32, "attention": "sdpa",
                         "device": "cpu", **tech})


# The three heaviest cases (full traces of 4-6 layers, ~10-30 s each on 2 cores) run with `-m slow`.
_SLOW = pytest.mark.slow
GRID = [
    ("llama", 4, {}),
    pytest.param("llama", 4, {"lora_rank": 4, "checkpointing": "full", "loss": "chunked", "loss_chunk": 16,
                              "precision": "bf16-pure"}, marks=_SLOW),
    pytest.param("qwen2", 4, {"lora_rank": 4, "attention": "math"}, marks=_SLOW),
    pytest.param("mistral", 6, {"checkpointing": "every:2", "lora_rank": 4}, marks=_SLOW),
    ("gemma", 4, {"precision": "bf16", "optim": "sgd"}),
    ("gpt2", 4, {}),  # gelu_new and attention dropout in training
]


@pytest.mark.parametrize("family,n_layers,tech", GRID)
def test_extrapolated_trace_equals_the_full_trace(tmp_path, family, n_layers, tech):
    from memtrain.analysis.depth_trace import extrapolated_trace
    from memtrain.analysis.trace import trace_step

    cfg = _cfg(_model_dir(tmp_path, family, n_layers), **tech)
    full = trace_step(cfg, "cpu")
    ex = extrapolated_trace(cfg, "cpu")
    assert ex["method"] == "extrapolated" and ex["probe_layers"][1] < n_layers
    assert ex["by_category"] == full["by_category"]
    assert ex["peak_bytes"] == full["peak_bytes"] and ex["peak_phase"] == full["peak_phase"]
    assert ex["parameters"] == full["parameters"]


def test_probe_depths_follow_the_checkpointing_period(tmp_path):
    from memtrain.analysis.depth_trace import probe_depths

    deep = _model_dir(tmp_path, "llama", 32)
    assert probe_depths(_cfg(deep)) == (2, 3, "none")
    assert probe_depths(_cfg(deep, checkpointing="every:3")) == (2, 5, "every:3")  # 32 = 2 mod 3
    assert probe_depths(_cfg(deep, checkpointing="every:4")) == (4, 8, "every:4")
    # sqrt is every:round(sqrt(L)) of the real depth, not of the probe's
    assert probe_depths(_cfg(deep, checkpointing="sqrt")) == (2, 8, "every:6")  # 32 = 2 mod 6
    # shallow: tracing every layer is as cheap
    assert probe_depths(_cfg(_model_dir(tmp_path, "llama", 3))) is None
    # layers of two kinds (sliding and full attention): not one repeated layer
    mixed = _model_dir(tmp_path, "qwen2", 8, use_sliding_window=True, sliding_window=16, max_window_layers=4,
                       layer_types=["full_attention"] * 4 + ["sliding_attention"] * 4)
    assert probe_depths(_cfg(mixed)) is None


def test_estimate_cli_says_how_it_traced(tmp_path, capsys):
    from memtrain.cli import main

    d = _model_dir(tmp_path, "gemma", 4)
    # A LoRA target named by its path, which the analytic model does not cover: traced.
    flags = ["estimate", "--model", str(d), "--seq-len", "32", "--batch-size", "2", "--attention", "sdpa",
             "--lora-rank", "4", "--lora-targets", "self_attn.q_proj,v_proj", "--json"]
    assert main(flags) == 0
    ex = json.loads(capsys.readouterr().out)
    assert main([*flags, "--full-trace"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert ex["method"] == "extrapolated" and ex["probe_layers"] == [2, 3] and "2 and 3 decoder layers" in ex["note"]
    assert full["method"] == "trace" and full["probe_layers"] is None and "every layer" in full["note"]
    assert ex["peak_bytes"] == full["peak_bytes"] and ex["bytes"] == full["bytes"]


@pytest.mark.parametrize("tech", [{}, {"lora_rank": 4}], ids=["full", "lora"])
def test_a_traced_estimate_counts_the_trainable_parameters_train_records(tmp_path, tech, capsys):
    """OPT has no analytic model: its estimate is traced (from 2 + 3 layers of the 6) and gives the
    trainable parameters train records (the adapters alone under LoRA), in the JSON and the text."""
    import torch

    from memtrain.cli import main
    from memtrain.training.step import build_state

    d = tmp_path / "opt-6"
    tiny_config("opt", 6).save_pretrained(d)
    cfg = _cfg(d, **tech)
    trained = build_state(cfg, torch.device("cpu")).trainable_parameters
    flags = ["estimate", "--model", str(d), "--batch-size", "2", "--seq-len", "32", "--device-type", "cpu",
             *(["--lora-rank", "4"] if tech else [])]
    assert main([*flags, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "extrapolated" and out["trainable_parameters"] == trained
    assert trained < out["parameters"] if tech else trained == out["parameters"]
    assert main(flags) == 0
    assert f"({trained:,} trainable)" in capsys.readouterr().out.splitlines()[0]
