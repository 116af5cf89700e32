"""The GPU tests' training data reads without optional packages.

``pytest -m gpu`` runs on machines without ``datasets`` (reading .jsonl needs it); there its
training tests must still train, so they read folders of .txt files. These CPU checks run the
same corpora through ``memtrain train`` with ``datasets`` made unimportable, so a corpus too
small for the document-level validation split, or one that needs ``datasets``, fails here and not
first on a GPU machine."""

from __future__ import annotations

import math
import sys

import pytest

from memtrain.config.run import build_config
from memtrain.training.train import train


@pytest.fixture
def without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError


def test_the_text_corpus_of_the_gpu_training_tests_trains_without_datasets(without_datasets, tiny_text_run):
    result = train(build_config({**tiny_text_run, "steps": 2, "warmup_steps": 0}))
    assert math.isfinite(result["val_loss"])


def test_the_transformers_gpu_tests_corpus_trains_without_datasets(without_datasets, tmp_path, tmp_path_factory):
    pytest.importorskip("transformers")
    from test_hf_gpu import corpus as gpu_corpus
    from test_hf_models import make_model_dir, run_cfg, tokenizer_files

    tokenizers = tokenizer_files.__wrapped__(tmp_path_factory)
    model_dir = make_model_dir(tmp_path / "models", "llama", tokenizers)

    folder = gpu_corpus.__wrapped__(tmp_path_factory)  # the fixture's own body
    result = train(run_cfg(model_dir, folder, tmp_path, steps=2))
    assert math.isfinite(result["val_loss"])
