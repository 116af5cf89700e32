"""Folders and files that train and --resume read: model folders (--model DIR), their
tokenizers, dataset folders (--data hf:DIR) and checkpoints (single-file and sharded).

Only regular files inside the folder are ever opened (a FIFO would block the run forever, a
link could lead anywhere), a folder's tokenizer decides the token ids on every data path, and
a file of the right kind with the wrong contents is one ``error:`` line and exit 2 before the
first step, never a run that fails at its end.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main
from memtrain.config import ConfigError, build_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 320
RUN = {"seq_len": 16, "batch_size": 2, "steps": 2, "warmup_steps": 0, "val_blocks": 2, "warmup_timing_steps": 1,
       "progress": False, "attention": "sdpa", "device": "cpu"}
TEXTS = [f"Question {i}: " + " ".join("memory gradient tensor batch layer attention optimizer checkpoint".split()[(i + j) % 8]
                                      for j in range(30)) for i in range(120)]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    return lines[0]


@contextlib.contextmanager
def unblocks(fifo: Path, after_s: float = 60.0):
    """Should anything block opening ``fifo`` for reading, open and close its write end after
    ``after_s`` seconds: the reader then sees end-of-file, so a test of a hang fails instead of
    hanging. The block also must end before that: a refusal never waits."""
    stop = threading.Event()

    def writer() -> None:
        if stop.wait(after_s):
            return
        while not stop.is_set():
            with contextlib.suppress(OSError):  # ENXIO: no reader (yet)
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            stop.wait(0.1)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    assert time.monotonic() - start < after_s, f"opening {fifo} blocked"


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE of ~300 tokens (ids far below GPT-2's) saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=VOCAB - 20, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(d)
    return d


def _gpt2_config(**kw):
    return transformers.GPT2Config(**{"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64, "vocab_size": VOCAB,
                                      "bos_token_id": 0, "eos_token_id": 0, **kw})


def model_folder(root: Path, tokenizer_dir: Path, weights: bool = False, **kw) -> Path:
    """A folder as a user brings it: config.json, the tokenizer's files, optionally weights."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = _gpt2_config(**kw)
    cfg.save_pretrained(root)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, root / f.name)
    if weights:
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("corpus") / "posts.jsonl"
    p.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return p


def _flags(model: Path, corpus: Path, out: Path, **kw) -> list[str]:
    return ["train", *cli_flags({**RUN, "data": str(corpus), "out": str(out), **kw}), "--model", str(model)]


# ------------------------------------------------------------------------------ 1. the model's tokenizer on every data path
def test_a_model_folders_tokenizer_makes_the_ids_whether_or_not_the_cache_can_be_written(
        tokenizer_dir, corpus, tmp_path, monkeypatch):
    """The tokens, and a run's result, are the folder tokenizer's with the token cache writable
    and with MEMTRAIN_CACHE at a place no folder can be created (a path under a file)."""
    from memtrain.data import prepare_tokens
    from memtrain.models import data_tokenizer
    from memtrain.train import train

    model = model_folder(tmp_path / "m", tokenizer_dir)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    settings = {**RUN, "data": str(corpus), "model": str(model)}
    tok = data_tokenizer(build_config(settings))
    results, tokens = {}, {}
    for where, cache in (("writable", tmp_path / "cache"), ("unwritable", blocker / "cache")):
        monkeypatch.setenv("MEMTRAIN_CACHE", str(cache))
        cfg = build_config({**settings, "out": str(tmp_path / where)})
        splits = prepare_tokens(cfg.data, progress=False, tokenizer=tok)
        assert splits.tokenizer == tok.name and int(splits.train.max()) < tok.n_vocab, where
        tokens[where] = splits.train.tolist() + splits.val.tolist()
        results[where] = train(cfg)
    assert (tmp_path / "cache").is_dir()  # the writable run did cache its tokens
    assert tokens["unwritable"] == tokens["writable"]
    first = tok.tok(TEXTS[0], add_special_tokens=False)["input_ids"]
    assert any(tokens["writable"][i:i + len(first)] == first for i in range(0, len(tokens["writable"]) - len(first)))
    for where, res in results.items():
        assert res["data"]["tokenizer"] == tok.name and res["data"]["tokenizer"].startswith("hf-"), where
    assert results["unwritable"]["loss_history"] == results["writable"]["loss_history"]


def test_the_result_names_gpt2_for_memtrains_own_model(small_corpus, tmp_path):
    from memtrain.train import train

    res = train(build_config({**TINY_MODEL, **RUN, "data": str(small_corpus), "out": str(tmp_path / "o"),
                              "attention": "math"}))
    assert res["data"]["tokenizer"] == "gpt2"
