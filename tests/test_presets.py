"""Every bench preset runs a few training steps on CPU, and the bench's scales are sound."""

from __future__ import annotations

import pytest

from conftest import TINY_MODEL
from memtrain.bench.technique_sets import TECHNIQUES, technique_overrides
from memtrain.config.run import build_config
from memtrain.techniques.facts import FOREIGN_LOSS_KERNELS, precision_facts
from memtrain.training.train import train


# compile: slow on CPU (below); fp8 needs FP8 tensor cores (CUDA 8.9+), its CPU refusal: test_fp8.py;
# the library loss kernels (liger, cce) are Triton code, their CPU refusal: test_loss_kernels.py.
@pytest.mark.parametrize("name", [n for n in TECHNIQUES
                                  if n != "compile" and not precision_facts(TECHNIQUES[n].get("precision", "fp32")).fp8
                                  and TECHNIQUES[n].get("loss_kernel", "memtrain") not in FOREIGN_LOSS_KERNELS])
def test_preset_trains_on_cpu(name, small_corpus, tmp_path):
    overrides = technique_overrides(name, "quick")
    if overrides.get("window"):
        overrides["window"] = 16
    cfg = build_config({**TINY_MODEL, "data": str(small_corpus), "batch_size": 2, "seq_len": 32, "steps": 3,
                        "warmup_steps": 1, "val_blocks": 2, "progress": False, "out": str(tmp_path)}, overrides)
    r = train(cfg)
    assert r["steps"] == 3 and all(x == x for x in r["loss_history"])  # finite, not NaN
    assert r["memory"]["peak_bytes"] > 0


@pytest.mark.slow
def test_compile_preset_trains_on_cpu(small_corpus, tmp_path):
    cfg = build_config({**TINY_MODEL, "data": str(small_corpus), "batch_size": 2, "seq_len": 32, "steps": 3,
                        "warmup_steps": 1, "val_blocks": 2, "progress": False, "out": str(tmp_path)},
                       technique_overrides("compile", "quick"))
    assert train(cfg)["steps"] == 3


@pytest.mark.bf16_heavy  # default model, four BF16 rows: minutes on a CPU without native BF16
def test_lowest_memory_preset_is_lowest(small_corpus, tmp_path):
    """On the default vocabulary, the lowest-memory preset's tracked peak is below every other
    preset's that trains the same model (LoRA and the window change what is trained)."""
    peaks = {}
    for name in ("baseline", "bf16", "chunked-loss", "adamw-8bit", "lowest-memory"):
        cfg = build_config({"data": str(small_corpus), "batch_size": 2, "seq_len": 64, "steps": 2,
                            "warmup_steps": 1, "val_blocks": 1, "progress": False, "dropout": 0.0,
                            "n_layers": 2, "out": str(tmp_path)}, technique_overrides(name, "quick"))
        peaks[name] = train(cfg)["memory"]["peak_bytes"]
    assert min(peaks, key=peaks.get) == "lowest-memory", peaks
