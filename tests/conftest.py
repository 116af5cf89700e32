"""Shared fixtures: an isolated token cache, a small local corpus, tiny-model settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

SHARED_SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "stackoverflow_posts_sample.xml"

# A model small enough that a training step takes milliseconds on CPU.
TINY_MODEL = {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 64, "dropout": 0.0}


def pytest_collection_modifyitems(config, items):
    """A ``bf16_heavy`` test is ``slow`` on a CPU without native BF16, where a BF16 matmul of the
    default vocabulary's LM head takes seconds (5-200x FP32), and runs by default elsewhere."""
    heavy = [item for item in items if item.get_closest_marker("bf16_heavy")]
    if not heavy:
        return
    from memtrain.device import probe

    # Before pytest's own -m filter (conftest hooks run first), so "not slow" sees the marker.
    if not probe("cpu", measure=False, kernels=False).native_bf16:
        for item in heavy:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Every test gets a token cache of its session, never the user's ~/.cache."""
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "token-cache"))


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A JSONL corpus of real-looking technical text (a few thousand tokens)."""
    import json

    d = tmp_path_factory.mktemp("corpus")
    path = d / "posts.jsonl"
    words = ("memory gradient tensor batch layer attention optimizer checkpoint python function "
             "value error list string return class module import loop index").split()
    with open(path, "w") as fh:
        for i in range(300):
            body = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + i % 30))
            fh.write(json.dumps({"text": f"Question {i}: {body}."}) + "\n")
    return path


@pytest.fixture
def tiny_run(small_corpus, tmp_path) -> dict:
    """Flat config overrides for a fast training run on the small corpus."""
    return {**TINY_MODEL, "data": str(small_corpus), "batch_size": 4, "seq_len": 32, "steps": 6,
            "warmup_steps": 2, "val_blocks": 4, "progress": False, "out": str(tmp_path / "run"),
            "warmup_timing_steps": 2}
