"""Every bench preset runs a few training steps on CPU, and the bench's scales are sound."""

from __future__ import annotations

import functools

import pytest

from conftest import TINY_MODEL
from memtrain.bench.technique_sets import TECHNIQUES, technique_overrides
from memtrain.config.run import build_config
from memtrain.techniques import order
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.facts import FOREIGN_LOSS_KERNELS, precision_facts
from memtrain.training.train import train


def _trains_on_cpu(name: str) -> bool:
    """fp8 needs FP8 tensor cores (CUDA 8.9+), its CPU refusal: test_fp8.py; the library loss kernels
    (liger, cce) are Triton code, their CPU refusal: test_loss_kernels.py."""
    return (not precision_facts(TECHNIQUES[name].get("precision", "fp32")).fp8
            and TECHNIQUES[name].get("loss_kernel", "memtrain") not in FOREIGN_LOSS_KERNELS)


ON_CPU = [n for n in TECHNIQUES if _trains_on_cpu(n)]
COMPILED = [n for n in ON_CPU if TECHNIQUES[n].get("compile")]


def _preset_config(name: str, corpus, out):
    overrides = technique_overrides(name, "quick")
    if overrides.get("window"):
        overrides["window"] = 16
    return build_config({**TINY_MODEL, "data": str(corpus), "batch_size": 2, "seq_len": 32, "steps": 3,
                         "warmup_steps": 1, "val_blocks": 2, "progress": False, "out": str(out)}, overrides)


@pytest.mark.parametrize("name", ON_CPU)
def test_preset_trains_on_cpu(name, small_corpus, tmp_path, monkeypatch):
    if name in COMPILED:
        # inductor's C++ kernels take 20-40 s a preset on a cold cache: here the same graphs are
        # traced and partitioned as inductor would (dynamo, AOTAutograd, the min-cut partitioner
        # that --compile-memory-budget steers) without building kernels; the slow test builds them.
        monkeypatch.setattr(order, "apply_compile", functools.partial(apply_compile, backend="aot_eager_decomp_partition"))
    r = train(_preset_config(name, small_corpus, tmp_path))
    assert r["steps"] == 3 and all(x == x for x in r["loss_history"])  # finite, not NaN
    assert r["memory"]["peak_bytes"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", COMPILED)
def test_compile_preset_trains_on_cpu_with_inductor(name, small_corpus, tmp_path):
    import torch

    torch.compiler.reset()  # dynamo's in-process cache would serve one preset's graphs to the next
    r = train(_preset_config(name, small_corpus, tmp_path))
    assert r["steps"] == 3 and all(x == x for x in r["loss_history"])


@pytest.mark.bf16_heavy  # four BF16 rows with the 50257-row head: slow on a CPU without native BF16
def test_lowest_memory_preset_is_lowest(small_corpus, tmp_path):
    """On the default vocabulary, the lowest-memory preset's tracked peak is below every other
    preset's that trains the same model (LoRA and the window change what is trained)."""
    peaks = {}
    for name in ("baseline", "bf16", "chunked-loss", "adamw-8bit", "lowest-memory"):
        # The tiny model's shapes: torchao's per-shape compiled steps are then the ones the presets'
        # own test compiled (a cold compile of the default model's shapes takes a minute or more).
        cfg = build_config({**TINY_MODEL, "data": str(small_corpus), "batch_size": 2, "seq_len": 64, "steps": 2,
                            "warmup_steps": 1, "val_blocks": 1, "progress": False, "out": str(tmp_path)},
                           technique_overrides(name, "quick"))
        peaks[name] = train(cfg)["memory"]["peak_bytes"]
    assert min(peaks, key=peaks.get) == "lowest-memory", peaks
