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
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import TINY_MODEL, cli_flags, tiny_run_state
from memtrain.cli import main
from memtrain.config.run import ConfigError, build_config

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


def _llama_folder_with(tmp_path: Path, **fields: object) -> Path:
    """A one-layer tiny Llama folder (``tmp_path / "m"``) whose config.json has ``fields`` set."""
    from tiny_families import tiny_config

    folder = tmp_path / "m"
    tiny_config("llama", 1).save_pretrained(folder)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **fields}))
    return folder


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
    from memtrain.training.train import train

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
    from memtrain.training.train import train

    res = train(build_config({**TINY_MODEL, **RUN, "data": str(small_corpus), "out": str(tmp_path / "o"),
                              "attention": "math"}))
    assert res["data"]["tokenizer"] == "gpt2"


# ------------------------------------------------------------------------------ 2. model folders
@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "special_tokens_map.json", "model.safetensors"])
def test_a_fifo_in_a_model_folder_is_refused_without_being_opened(tokenizer_dir, corpus, tmp_path, capsys, name):
    """config.json and the tokenizer files memtrain reads, a file only transformers reads, and
    a weight file: each a FIFO, each refused (opening one blocks until a writer comes)."""
    model = model_folder(tmp_path / "m", tokenizer_dir, weights=name.endswith(".safetensors"))
    (model / name).unlink(missing_ok=True)
    os.mkfifo(model / name)
    capsys.readouterr()  # what saving the weights printed
    with unblocks(model / name):
        assert main(_flags(model, corpus, tmp_path / "o")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"'{name}' is a FIFO" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "additional_chat_templates/t.jinja"])
def test_a_file_too_large_to_read_whole_is_refused_before_it_is_read(tokenizer_dir, corpus, tmp_path, capsys,
                                                                      monkeypatch, name):
    """A 3 GB tokenizer.json (a sparse file) took 73 s and 16 GB of memory before its refusal:
    transformers reads a model folder's config and tokenizer files whole. Refused by its size, from
    ``stat``, before anything reads it; a large file no reader opens (a README) stays allowed."""
    from memtrain.models import source

    monkeypatch.setattr(source, "MAX_READ_WHOLE_BYTES", 1 << 20)  # a 1 MiB limit: a fast test
    model = model_folder(tmp_path / "m", tokenizer_dir)
    (model / name).parent.mkdir(exist_ok=True)
    with open(model / name, "ab") as f:
        f.truncate(2 << 20)  # sparse: no bytes written
    with open(model / "README.md", "wb") as f:
        f.truncate(2 << 20)
    capsys.readouterr()
    assert main(_flags(model, corpus, tmp_path / "o")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{name!r} is larger than 1,048,576 bytes" in line and "replace it with the model's own file" in line, line
    assert not (tmp_path / "o").exists()
    (model / name).unlink()
    if name == "config.json":
        return
    assert main(["estimate", "--model", str(model), "--seq-len", "16"]) == 0  # the README is never read


@pytest.mark.parametrize("text, words", [("{not json", "Expecting property name"),
                                         ("{}", "lacks the field 'added_tokens'"),
                                         ("[" * 100_000 + "]" * 100_000, "recursion")])
def test_a_garbled_tokenizer_json_is_one_line_saying_what_to_fix(tokenizer_dir, corpus, tmp_path, capsys, text, words):
    """A tokenizer.json that is no JSON, an empty object, or 100,000 levels deep: one line, but it
    said only the parser's words ("cannot load the tokenizer of --model ...: 'added_tokens'"), not
    what is wrong nor what to change."""
    model = model_folder(tmp_path / "m", tokenizer_dir)
    (model / "tokenizer.json").write_text(text)
    capsys.readouterr()
    assert main(_flags(model, corpus, tmp_path / "o")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot load the tokenizer of --model" in line and words in line, line
    assert "fix or replace its tokenizer files" in line, line
    assert not (tmp_path / "o").exists()


def test_a_device_or_fifo_given_as_the_model_is_named_itself(tmp_path, capsys):
    """`--model /dev/null` was refused for another entry of /dev ("'autofs' is a character
    device ... remove or replace that entry"), its folder being checked as a model folder."""
    fifo = tmp_path / "spec"
    os.mkfifo(fifo)
    for spec, kind in (("/dev/null", "a character device"), (str(fifo), "a FIFO")):
        with unblocks(fifo):
            assert main(["estimate", "--model", spec]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"--model {spec!r} is {kind}, not a config.json or a model folder" in line, line


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model.safetensors"])
def test_a_link_out_of_a_model_folder_is_refused(tokenizer_dir, corpus, tmp_path, capsys, name):
    """A symbolic link to a file outside the folder is refused (a readable file, so nothing
    else would stop it); a link to a file inside the folder is fine."""
    model = model_folder(tmp_path / "m", tokenizer_dir, weights=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(model / name, outside / name)
    (model / name).symlink_to(outside / name)
    capsys.readouterr()  # what saving the weights printed
    assert main(_flags(model, corpus, tmp_path / "o")) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"'{name}' is a symbolic link to" in line and "outside" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("verb", ["train", "generate"])
@pytest.mark.parametrize("named", ["a FIFO outside", "../a shard outside", "an absolute path"])
def test_a_safetensors_index_naming_a_file_outside_the_folder_is_refused(tokenizer_dir, corpus, tmp_path, capsys,
                                                                         verb, named):
    """transformers opens ``folder/NAME`` for each file a sharded model's index names: ``../x``
    or an absolute path read past the checks of the folder's entries (a FIFO blocked the run, a
    device such as /dev/zero filled the memory). Only the folder's own shards, by name, pass."""
    model = model_folder(tmp_path / "m", tokenizer_dir)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_gpt2_config()).save_pretrained(model, max_shard_size="20KB")
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    fifo = outside / "fifo.safetensors"
    os.mkfifo(fifo)
    shutil.copy(model / first, outside / first)
    target = {"a FIFO outside": str(fifo), "../a shard outside": f"../elsewhere/{first}",
              "an absolute path": str(outside / first)}[named]
    index["weight_map"] = {k: target if v == first else v for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    capsys.readouterr()  # what saving the weights printed
    argv = _flags(model, corpus, tmp_path / "o") if verb == "train" else ["generate", str(model), "--max-new-tokens", "2"]
    with unblocks(fifo):
        assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"model.safetensors.index.json names {target!r}, which is not a *.safetensors file of the folder" in line
    assert not (tmp_path / "o").exists()


def test_links_inside_the_folder_and_a_hub_cache_snapshot_are_read(tokenizer_dir, tmp_path):
    """A Hugging Face cache snapshot links every file into ../../blobs: the snapshot folder is the
    model folder (its weights and tokenizer beside config.json), and the links are followed."""
    from memtrain.models import data_tokenizer, resolve
    from memtrain.models.auto_config import load_config

    plain = model_folder(tmp_path / "plain", tokenizer_dir)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(plain.iterdir()):
        shutil.copy(f, repo / "blobs" / f"blob-{f.name}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob-{f.name}")
    src = resolve(str(snapshot))
    assert src.directory == snapshot.resolve() and src.has_tokenizer()
    assert load_config(str(snapshot)).n_embd == 32
    tok = data_tokenizer(build_config({**RUN, "model": str(snapshot)}))
    assert tok is not None and tok.n_vocab == data_tokenizer(build_config({**RUN, "model": str(plain)})).n_vocab


def test_names_that_merely_start_like_tokenizer_files_are_not_the_tokenizer(tokenizer_dir, corpus, tmp_path, capsys):
    """A folder ``tokenizer_x`` trains (it was read as a tokenizer file: IsADirectoryError), and
    a file ``tokenizer_notes.json`` does not change the tokenizer's identity (the cache key)."""
    from memtrain.models import data_tokenizer

    model = model_folder(tmp_path / "m", tokenizer_dir)
    cfg = build_config({**RUN, "model": str(model)})
    before = data_tokenizer(cfg).name
    (model / "tokenizer_x").mkdir()
    (model / "tokenizer_x" / "notes.txt").write_text("a folder, not a tokenizer file")
    (model / "tokenizer_notes.json").write_text('{"unrelated": true}')
    assert data_tokenizer(cfg).name == before
    assert main(_flags(model, corpus, tmp_path / "o")) == 0, capsys.readouterr().err
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text().replace('"<eos>"', '"<end>"'))
    assert data_tokenizer(cfg).name != before  # the real tokenizer file does decide it


def test_weights_of_another_shape_are_one_error_line_naming_the_tensor(tokenizer_dir, corpus, tmp_path):
    """config.json says n_embd 48, the *.safetensors hold n_embd 32: one ``error:`` line naming a
    tensor and both shapes, exit 2 (transformers logs a table of every tensor, then raises).
    A subprocess: transformers' log handler holds the stderr of the process that imported it."""
    model = model_folder(tmp_path / "m", tokenizer_dir, weights=True)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "n_embd": 48}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "memtrain", *_flags(model, corpus, tmp_path / "o")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    line = _one_error_line(proc.stderr)
    found = re.search(r"do not fit its config\.json: (\S+) is \[([\d, ]+)\] in the \*\.safetensors but \[([\d, ]+)\] "
                      r"in the model \(and (\d+) more\)", line)
    assert found, line
    key, saved, built = found[1], [int(n) for n in found[2].split(",")], [int(n) for n in found[3].split(",")]
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert f.get_slice(key).get_shape() == saved
    with torch.device("meta"):
        fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model))
    assert list(fresh.state_dict()[key].shape) == built != saved
    assert not (tmp_path / "o").exists()


def test_a_dataset_folder_with_a_loading_script_is_refused_and_the_script_never_runs(corpus, tmp_path, capsys):
    marker = tmp_path / "script-ran"
    ds = tmp_path / "ds"
    ds.mkdir()
    shutil.copy(corpus, ds / "data.jsonl")
    (ds / "ds.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    run = {**TINY_MODEL, **RUN, "attention": "math", "data": f"hf:{ds}", "out": str(tmp_path / "o")}
    assert main(["train", *cli_flags(run)]) == 2
    assert "'ds.py' is a dataset loading script" in _one_error_line(capsys.readouterr().err)
    assert not marker.exists() and not (tmp_path / "o").exists()


def test_a_fifo_in_a_dataset_folder_is_refused_without_being_opened(corpus, tmp_path, capsys):
    ds = tmp_path / "ds"
    ds.mkdir()
    shutil.copy(corpus, ds / "a.jsonl")
    os.mkfifo(ds / "b.jsonl")
    run = {**TINY_MODEL, **RUN, "attention": "math", "data": f"hf:{ds}", "out": str(tmp_path / "o")}
    with unblocks(ds / "b.jsonl"):
        assert main(["train", *cli_flags(run)]) == 2
    assert "'b.jsonl' is a FIFO" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("cut", ["half", "last-100-bytes"])
def test_a_truncated_checkpoint_is_said_to_be_incomplete_by_every_reader(corpus, tmp_path, capsys, cut):
    """A checkpoint cut short (a copy stopped midway, a disk full while it was written) was called
    "not a memtrain checkpoint" by --resume, export and generate: the user went looking for
    another file. It is said to be incomplete, with what to do; nothing runs or is written."""
    from memtrain.checkpoints.exact import save_checkpoint

    whole = tmp_path / "whole.pt"
    save_checkpoint(whole, _run_state(build_config({**TINY_MODEL, "seq_len": 16, "batch_size": 2, "steps": 4})))
    data = whole.read_bytes()
    ckpt = tmp_path / "cut.pt"
    ckpt.write_bytes(data[:len(data) // 2] if cut == "half" else data[:-100])
    run = {**TINY_MODEL, **RUN, "data": str(corpus), "steps": 4, "out": str(tmp_path / "o"), "resume": str(ckpt)}
    for argv in (["train", *cli_flags(run)], ["export", str(ckpt), str(tmp_path / "x")], ["generate", str(ckpt)]):
        assert main(argv) == 2, argv
        line = _one_error_line(capsys.readouterr().err)
        assert f"checkpoint {str(ckpt)!r} is incomplete" in line and "copy it again" in line, line
    assert not (tmp_path / "o").exists() and not (tmp_path / "x").exists()
    (tmp_path / "junk.pt").write_bytes(b"not a zip")  # a file of another kind keeps its words
    assert main(["generate", str(tmp_path / "junk.pt")]) == 2
    assert "it is not a memtrain checkpoint" in _one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------ 3. sharded checkpoints: storage files
def _run_state(cfg):
    return tiny_run_state(cfg, batch_index=1)


SHARDED = {**TINY_MODEL, "seq_len": 16, "batch_size": 2, "steps": 4, "distributed": "ddp", "device": "cpu"}


@pytest.fixture
def sharded_checkpoint(one_rank_group, tmp_path) -> Path:
    """A real 1-rank sharded checkpoint after one optimizer step."""
    from memtrain.checkpoints.distributed import save_checkpoint

    run = _run_state(build_config(SHARDED))
    x = torch.randint(0, 100, (2, 16))
    run.model(x, x).backward()
    run.optimizer.step()
    run.step, run.losses = 1, [3.0]
    save_checkpoint(tmp_path / "ck", run)
    return tmp_path / "ck"


def _rewrite_storage(ckpt: Path, **change) -> None:
    """Rewrite every storage entry of the checkpoint's .metadata with ``change``."""
    import dataclasses

    from memtrain.checkpoints.safe_dcp import read_metadata

    metadata = read_metadata(ckpt)
    metadata.storage_data = {k: dataclasses.replace(v, **change) for k, v in metadata.storage_data.items()}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def _data_file(ckpt: Path) -> Path:
    (data,) = ckpt.glob("*.distcp")
    return data


@pytest.mark.parametrize("where", ["absolute", "dotdot", "link-out", "fifo", "past-end"])
def test_sharded_storage_paths_outside_the_checkpoint_are_refused(sharded_checkpoint, tmp_path, where):
    """Storage a .metadata names is read only from regular files inside the checkpoint, and only
    within their size; the outside file is a valid copy of the data, so a read would succeed."""
    from memtrain.checkpoints.distributed import load_checkpoint

    ckpt = sharded_checkpoint
    data = _data_file(ckpt)
    outside = tmp_path / "outside" / data.name
    outside.parent.mkdir()
    shutil.copy(data, outside)
    fifo = ckpt / "pipe.distcp"
    if where == "absolute":
        _rewrite_storage(ckpt, relative_path=str(outside))
    elif where == "dotdot":
        _rewrite_storage(ckpt, relative_path=f"../outside/{data.name}")
    elif where == "link-out":
        data.unlink()
        data.symlink_to(outside)
    elif where == "fifo":
        os.mkfifo(fifo)
        _rewrite_storage(ckpt, relative_path=fifo.name)
    else:
        _rewrite_storage(ckpt, offset=data.stat().st_size)
    with unblocks(fifo) if where == "fifo" else contextlib.nullcontext():
        with pytest.raises(ConfigError, match="is refused") as info:
            load_checkpoint(ckpt, _run_state(build_config(SHARDED)))
    assert "\n" not in str(info.value)


def test_a_fifo_as_the_sharded_metadata_or_rank_file_is_refused(sharded_checkpoint):
    from memtrain.checkpoints.distributed import load_checkpoint

    for name in (".metadata", "rank-0.pt"):
        saved = (sharded_checkpoint / name).read_bytes()
        (sharded_checkpoint / name).unlink()
        os.mkfifo(sharded_checkpoint / name)
        with unblocks(sharded_checkpoint / name):
            with pytest.raises(ConfigError, match=rf"its {re.escape(name)} is a FIFO|'{re.escape(name)}' is a FIFO"):
                load_checkpoint(sharded_checkpoint, _run_state(build_config(SHARDED)))
        (sharded_checkpoint / name).unlink()
        (sharded_checkpoint / name).write_bytes(saved)
    state = load_checkpoint(sharded_checkpoint, _run_state(build_config(SHARDED)))  # intact again: it loads
    assert state == {"step": 1, "losses": [3.0]}


# ------------------------------------------------------------------------------ 4. what a checkpoint holds
@pytest.fixture(scope="module")
def saved(small_corpus_module, tmp_path_factory) -> tuple[dict, Path]:
    """A real single-file checkpoint of a tiny GPT run after 2 of 4 steps, and the run's settings."""
    from memtrain.training.train import train

    root = tmp_path_factory.mktemp("saved")
    run = {**TINY_MODEL, **RUN, "attention": "math", "steps": 4, "data": str(small_corpus_module),
           "out": str(root / "o")}
    train(build_config({**run, "stop_after": 2, "save": str(root / "ck.pt")}))
    return run, root / "ck.pt"


@pytest.fixture(scope="module")
def small_corpus_module(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("gptcorpus") / "posts.jsonl"
    p.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in TEXTS))
    return p


def _exp_avg_of_another_shape(s):
    s["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3)


def _group_lr_as_text(s):
    s["optimizer"]["param_groups"][0]["lr"] = "0.001"


DAMAGE = {
    "losses as text": (lambda s: s.update(losses="abc"), "losses"),
    "a loss as text": (lambda s: s.update(losses=[1.0, "2.0"]), "losses"),
    "fewer losses than steps": (lambda s: s.update(losses=[1.0]), "1 losses for 2 steps"),
    "skipped_steps as text": (lambda s: s.update(skipped_steps="0"), "skipped_steps"),
    "rng as text": (lambda s: s.update(rng_cpu="seed"), "rng_cpu"),
    "data position as text": (lambda s: s.update(loader={"epoch": "0", "batch_index": 1}), "data position"),
    "scheduler lr as text": (lambda s: s["scheduler"].update(base_lrs=["0.001"]), "base_lrs"),
    "scheduler step as text": (lambda s: s["scheduler"].update(last_epoch="2"), "last_epoch"),
    "optimizer lr as text": (_group_lr_as_text, "lr"),
    "optimizer moment of another shape": (_exp_avg_of_another_shape, "shape [3]"),
    "optimizer step as text": (lambda s: s["optimizer"]["state"][0].update(step="2"), "optimizer state"),
    "model weight as text": (lambda s: s["model"].update({next(iter(s["model"])): "w"}), "model"),
    "scaler as text": (lambda s: s.update(scaler="on"), "scaler"),
    # Checked before the run's end is compared with it: "raise --stop-after" was the advice.
    "negative step": (lambda s: s.update(step=-3), "its step is -3"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_checkpoint_with_wrong_typed_fields_is_refused_before_the_first_step(saved, tmp_path, capsys,
                                                                                 monkeypatch, damage):
    """Each field memtrain uses from a checkpoint, of the wrong type or shape: one ``error:`` line
    naming it and exit 2, before any step runs and before anything is written."""
    import memtrain.training.step as step_module

    run, ckpt = saved
    state = torch.load(ckpt, weights_only=True)
    change, words = DAMAGE[damage]
    change(state)
    bad = tmp_path / "bad.pt"
    torch.save(state, bad)
    steps = []
    monkeypatch.setattr(step_module, "train_step", lambda *a, **k: steps.append(1) or 0.0)
    out = tmp_path / "r"
    assert main(["train", *cli_flags({**run, "resume": str(bad), "out": str(out)})]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "is damaged" in line and words in line, line
    assert steps == [] and not (out / "result.json").exists() and not (out / "metrics.jsonl").exists()


def test_the_undamaged_checkpoint_resumes(saved, tmp_path):
    """The checkpoint the damage tests start from passes every check and continues the run."""
    from memtrain.training.train import train

    run, ckpt = saved
    res = train(build_config({**run, "resume": str(ckpt), "out": str(tmp_path / "r")}))
    assert res["steps_run"] == 2 and len(res["loss_history"]) == 4


def test_sharded_checkpoint_fields_of_the_wrong_type_are_refused(sharded_checkpoint):
    """meta.json's losses and a rank file's fields, wrong-typed, are refused before the load."""
    from memtrain.checkpoints.distributed import load_checkpoint

    meta_path, rank_path = sharded_checkpoint / "meta.json", sharded_checkpoint / "rank-0.pt"
    meta, rank = json.loads(meta_path.read_text()), torch.load(rank_path, weights_only=True)
    for file, damaged, words in [
        (meta_path, {**meta, "losses": ["3.0"]}, "losses"),
        (meta_path, {**meta, "losses": [3.0, 2.0]}, "2 losses for 1 steps"),
        (meta_path, {**meta, "loader": {"epoch": 0, "batch_index": "1"}}, "data position"),
        (rank_path, {**rank, "skipped_steps": "0"}, "skipped_steps"),
        (rank_path, {**rank, "rng_cpu": [1, 2]}, "rng_cpu"),
        (rank_path, {**rank, "scheduler": {**rank["scheduler"], "base_lrs": [*rank["scheduler"]["base_lrs"], 1e-3]}},
         "learning rates for"),
    ]:
        if file == meta_path:
            meta_path.write_text(json.dumps(damaged))
        else:
            torch.save(damaged, rank_path)
        with pytest.raises(ConfigError, match="is damaged") as info:
            load_checkpoint(sharded_checkpoint, _run_state(build_config(SHARDED)))
        assert words in str(info.value) and file.name in str(info.value)
        meta_path.write_text(json.dumps(meta))
        torch.save(rank, rank_path)
    assert load_checkpoint(sharded_checkpoint, _run_state(build_config(SHARDED)))["step"] == 1


def test_a_link_out_as_the_sharded_meta_json_is_refused(sharded_checkpoint, tmp_path):
    """meta.json linked to a (valid) copy outside the checkpoint: refused by the resume check and
    by the load, which read it."""
    from memtrain.checkpoints.distributed import load_checkpoint
    from memtrain.training.resume_check import saved_run

    outside = tmp_path / "meta-copy.json"
    shutil.move(sharded_checkpoint / "meta.json", outside)
    (sharded_checkpoint / "meta.json").symlink_to(outside)
    with pytest.raises(ConfigError, match="its meta.json is a symbolic link to .* outside"):
        saved_run(sharded_checkpoint)
    with pytest.raises(ConfigError, match="its meta.json is a symbolic link to .* outside"):
        load_checkpoint(sharded_checkpoint, _run_state(build_config(SHARDED)))


def test_a_sharded_meta_json_too_large_to_read_whole_is_refused_from_its_size(sharded_checkpoint, monkeypatch):
    """A sharded checkpoint's meta.json was read whole, with no limit, by the resume check and by
    the load (a sparse 1 GiB one went into memory as bytes, then text). One over the limit that
    bounds result.json is refused from its size by both, naming it, unread."""
    from memtrain.checkpoints.distributed import load_checkpoint
    from memtrain.files import results
    from memtrain.training.preflight import saved_run

    monkeypatch.setattr(results, "MAX_WHOLE_JSON_BYTES", 1 << 20)  # 1 MiB: a fast test
    meta = sharded_checkpoint / "meta.json"
    with open(meta, "ab") as f:
        f.truncate(2 << 20)  # sparse
    opened = []
    real_read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: opened.append(self.name) or real_read_text(self, *a, **k))
    with pytest.raises(ConfigError, match="its meta.json is larger than 1,048,576 bytes"):
        saved_run(sharded_checkpoint)
    with pytest.raises(ConfigError, match="its meta.json is larger than 1,048,576 bytes"):
        load_checkpoint(sharded_checkpoint, _run_state(build_config(SHARDED)))
    assert "meta.json" not in opened


def test_a_zero1_rank_file_round_trips_and_a_moment_of_another_shape_is_refused(one_rank_group, tmp_path):
    """ZeRO-1 keeps its optimizer shard in the rank file (the outer groups without parameters):
    a real one loads; one whose Adam moment has another shape is refused before the load."""
    from memtrain.checkpoints.distributed import load_checkpoint, save_checkpoint
    from memtrain.distributed.wrapping import zero_redundancy

    cfg = build_config({**SHARDED, "distributed": "zero1"})

    def zero1_run():
        run = _run_state(cfg)
        run.optimizer = zero_redundancy(run.optimizer)
        run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, lambda s: 1.0)
        return run

    run = zero1_run()
    x = torch.randint(0, 100, (2, 16))
    run.model(x, x).backward()
    run.optimizer.step()
    run.step, run.losses = 1, [3.0]
    save_checkpoint(tmp_path / "ck", run)
    assert load_checkpoint(tmp_path / "ck", zero1_run()) == {"step": 1, "losses": [3.0]}
    rank = torch.load(tmp_path / "ck" / "rank-0.pt", weights_only=True)
    rank["optimizer"]["state"][0]["exp_avg"] = torch.zeros(5, 5)
    torch.save(rank, tmp_path / "ck" / "rank-0.pt")
    with pytest.raises(ConfigError, match=r"rank-0.pt' is damaged: its optimizer state exp_avg .* shape \[5, 5\]"):
        load_checkpoint(tmp_path / "ck", zero1_run())


class _RunsCode:
    """Unpickling this runs ``touch`` on a marker file: proof that a file was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", ["ckpt.pt", "model.bin", "run-state"])  # the last found by its zip bytes
@pytest.mark.parametrize("verb", [["estimate"], ["estimate", "--mode", "inference"], ["train", "--steps", "1"]])
def test_a_checkpoint_given_as_model_is_one_line_saying_what_model_takes(tmp_path, capsys, name, verb):
    marker = tmp_path / "was-unpickled"
    ckpt = tmp_path / name
    torch.save({"model": _RunsCode(marker)}, ckpt)
    assert main([*verb, "--model", str(ckpt), "--out", str(tmp_path / "out")] if verb[0] == "train"
                else [*verb, "--model", str(ckpt)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1, err
    assert "is a checkpoint, not a model config" in err and f"train --resume {ckpt}" in err and "memtrain export" in err
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_weights_file_or_a_sharded_checkpoint_as_model_is_one_line(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    assert main(["estimate", "--model", str(weights)]) == 2
    assert "is a weights file; give the folder holding it and its config.json" in capsys.readouterr().err
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"\x80\x04N.")  # DCP's pickled metadata: never read here
    (sharded / "meta.json").write_text("{}")
    assert main(["estimate", "--model", str(sharded)]) == 2
    assert "is a sharded memtrain checkpoint, not a model config" in capsys.readouterr().err


def test_resume_alone_of_a_model_folder_run_and_of_one_whose_folder_moved(tokenizer_dir, corpus, tmp_path, capsys):
    """`train --resume CKPT` alone takes the saved --model folder; once the folder has moved the
    line names the model, in the model resolution's own words (the checkpoint is not blamed)."""
    model = model_folder(tmp_path / "m", tokenizer_dir)
    ckpt = tmp_path / "out" / "ck.pt"  # inside its --out, which it lends
    assert main([*_flags(model, corpus, tmp_path / "out", steps=3, stop_after=2), "--save", str(ckpt)]) == 0
    capsys.readouterr()
    model.rename(tmp_path / "moved")
    assert main(["train", "--resume", str(ckpt)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--model {str(model)!r} is not a preset" in line and "holds settings" not in line
    (tmp_path / "moved").rename(model)
    assert main(["train", "--resume", str(ckpt)]) == 0
    assert json.loads((tmp_path / "out" / "result.json").read_text())["steps"] == 3


@pytest.mark.parametrize("window", [0, -3])
def test_a_config_window_that_lets_no_token_attend_is_refused_by_every_verb(tmp_path, capsys, window):
    """transformers masks every key with a sliding_window of 0 or less: the attention's output is
    zero and training ran silently without attention. A window of null, or one Qwen2 does not use
    (use_sliding_window false, or no layer past max_window_layers), passes."""
    transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=1, vocab_size=VOCAB, sliding_window=window).save_pretrained(tmp_path / "m")
    for argv in (["estimate"], ["estimate", "--mode", "inference"], ["train", "--steps", "1", "--out", str(tmp_path / "o")]):
        assert main([*argv, "--model", str(tmp_path / "m")]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"sliding_window {window} lets no token attend" in line and "write null for no window" in line
    assert not (tmp_path / "o").exists()
    transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=1, vocab_size=VOCAB, sliding_window=window,
                             use_sliding_window=False).save_pretrained(tmp_path / "q")
    assert main(["estimate", "--model", str(tmp_path / "q"), "--seq-len", "16"]) == 0
    # Nor does a window no layer uses (every layer before max_window_layers attends to all).
    transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=1, vocab_size=VOCAB, sliding_window=window, use_sliding_window=True,
                             max_window_layers=1).save_pretrained(tmp_path / "q2")
    assert main(["estimate", "--model", str(tmp_path / "q2"), "--seq-len", "16"]) == 0


@pytest.mark.parametrize("family, field, value", [
    ("llama", "rms_norm_eps", "NaN"), ("llama", "rope_theta", "Infinity"), ("gpt2", "layer_norm_epsilon", "-Infinity"),
    ("llama", "rope_scaling.factor", "1e999"),
])
def test_a_config_number_that_is_not_finite_is_refused_by_every_verb(tmp_path, capsys, family, field, value):
    """Python's json reads NaN, Infinity and 1e999: an rms_norm_eps of NaN trained into a loss of
    NaN, reported as a divergence to fix with a lower --lr (exit 1)."""
    from tiny_families import tiny_config

    tiny_config(family, 1).save_pretrained(tmp_path / "m")
    config = tmp_path / "m" / "config.json"
    data = json.loads(config.read_text())
    if field == "rope_scaling.factor":
        data["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    text = json.dumps(data).replace('"factor": 2.0', f'"factor": {value}')  # json.dumps writes no 1e999
    if "." not in field:
        text = text[:-1] + f', "{field}": {value}}}'  # a later key wins in json.loads
    config.write_text(text)
    shown = "Infinity" if value == "1e999" else value
    for argv in (["estimate", "--seq-len", "16"], ["estimate", "--mode", "inference", "--seq-len", "16"],
                 ["flops", "--seq-len", "16"], ["plan", "--budget", "1GiB", "--seq-len", "16"],
                 ["train", "--steps", "1", "--seq-len", "16", "--out", str(tmp_path / "o")]):
        assert main([*argv, "--model", str(tmp_path / "m")]) == 2, argv
        line = _one_error_line(capsys.readouterr().err)
        assert f"has {field} {shown}, not a finite number" in line, (argv, line)
    assert main(["generate", str(tmp_path / "m")]) == 2
    assert f"has {field} {shown}, not a finite number" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("family, field, value, words", [
    ("granite", "logits_scaling", None, "has logits_scaling null, not a number; granite divides by it"),
    ("granite", "logits_scaling", 0, "has logits_scaling 0; granite divides by it: write a number other than 0"),
    ("granite", "residual_multiplier", "2", 'has residual_multiplier "2", not a number; granite multiplies by it'),
    ("granite", "attention_multiplier", 10 ** 400, "too large for a float; granite multiplies by it"),
    ("cohere", "logit_scale", None, "has logit_scale null, not a number; cohere multiplies by it"),
    ("minicpm3", "dim_model_base", 0, "has dim_model_base 0; minicpm3 divides by it"),
])
def test_a_scale_field_that_is_no_number_is_one_line_naming_it(tmp_path, capsys, family, field, value, words):
    """A family's scale factor set to null, a string or 0: transformers types Cohere's logit_scale
    as optional, and `generate` stopped with `Tensor * None`'s TypeError; Granite's
    logits_scaling 0 stopped `train` with a ZeroDivisionError (exit 1, after the model was built)."""
    import transformers

    from memtrain.models.config_json import refuse_bad_scales

    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
                 num_hidden_layers=1, max_position_embeddings=128, vocab_size=50304)
    configs = {"granite": transformers.GraniteConfig, "cohere": transformers.CohereConfig,
               "minicpm3": lambda **kw: transformers.MiniCPM3Config(**kw, kv_lora_rank=16, q_lora_rank=16,
                                                                     qk_nope_head_dim=8, qk_rope_head_dim=8)}
    configs[family](**small).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    for argv in (["estimate", "--model", str(tmp_path / "m"), "--seq-len", "16"],
                 ["train", "--model", str(tmp_path / "m"), "--steps", "1", "--seq-len", "16", "--batch-size", "1",
                  "--out", str(tmp_path / "o")],
                 ["generate", str(tmp_path / "m"), "--prompt", "hi", "--seed", "1"]):
        assert main(argv) == 2, argv
        line = _one_error_line(capsys.readouterr().err)
        assert words in line and " there (or remove the field" in line, (argv, line)
    assert not (tmp_path / "o").exists()
    refuse_bad_scales({"model_type": "minicpm3", "scale_depth": None, "dim_model_base": None}, "c")  # its no-op scales


def _every_verb_refuses_the_folder(tmp_path: Path, capture, words: str) -> None:
    """estimate, generate and train on the folder tmp_path/m: each exit 2 with one error line holding
    ``words``, and train writes no run folder."""
    for argv in (["estimate", "--model", str(tmp_path / "m")], ["generate", str(tmp_path / "m")],
                 ["train", "--model", str(tmp_path / "m"), "--steps", "1", "--out", str(tmp_path / "o")]):
        assert main(argv) == 2, argv
        assert words in _one_error_line(capture.readouterr().err), argv
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("vocab", [0, -5])
def test_a_config_without_a_vocabulary_is_one_line_naming_the_field(tmp_path, capfd, vocab):
    """transformers logged a line for each special token outside the empty vocabulary before the
    refusal, which named a flag (--vocab-size) the user never gave."""
    _llama_folder_with(tmp_path, vocab_size=vocab)
    _every_verb_refuses_the_folder(tmp_path, capfd,
                                   f"config.json' has vocab_size {vocab}; a model needs a vocabulary of at least one token")
    # transformers' log handler holds the stderr it found at import: only a process of its own shows it.
    proc = subprocess.run([sys.executable, "-m", "memtrain", "estimate", "--model", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and "has vocab_size" in _one_error_line(proc.stderr)


@pytest.mark.parametrize("model_type", [["llama"], 7, {"name": "llama"}])
def test_a_model_type_that_is_no_name_is_one_line_naming_the_field(tmp_path, capsys, model_type):
    """A config.json whose model_type is a list, a number or an object (a damaged download) was said
    to have "no 'model_type'; it is not a transformers config.json": the field is named with its
    value on every verb."""
    _llama_folder_with(tmp_path, model_type=model_type)
    _every_verb_refuses_the_folder(tmp_path, capsys, f"config.json' has model_type {model_type!r}, where a family's "
                                                      "name such as 'llama' belongs")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_a_config_json_past_16_mib_is_refused_from_its_size_on_every_verb(tokenizer_dir, corpus, tmp_path, capsys,
                                                                           name):
    """A model's config.json holds tens of kilobytes; one padded to 100 MB was parsed several times
    over (a train took 360 MB more memory), up to the 256 MiB of any file read whole. Past
    16 MiB (a --config file's limit) it is refused from its size, unread, by every verb; a
    tokenizer.json of that size (Gemma's is 33 MB) is still read."""
    model = model_folder(tmp_path / "m", tokenizer_dir, weights=True)
    with open(model / name, "ab") as f:
        f.truncate((16 << 20) + 1)  # sparse: nothing is written
    capsys.readouterr()
    for argv in (_flags(model, corpus, tmp_path / "o"), ["estimate", "--model", str(model)],
                 ["generate", str(model), "--max-new-tokens", "2"]):
        assert main(argv) == 2, argv
        line = _one_error_line(capsys.readouterr().err)
        assert f"{name}' is larger than 16,777,216 bytes" in line, line
    assert not (tmp_path / "o").exists()
    from memtrain.models import source

    assert source._read_whole_limit(model / "tokenizer.json") == source.MAX_TOKENIZER_FILE_BYTES > 33 << 20


@pytest.mark.parametrize("name", ["tokenizer.json", "vocab.json", "merges.txt"])
def test_a_tokenizer_file_past_64_mib_is_refused_from_its_size(tokenizer_dir, corpus, tmp_path, capsys, name):
    """A tokenizer's files were bounded only by the 256 MiB of any file read whole, and parsing one
    takes many times its size in memory, all spent before a vocabulary too large is refused. Past
    64 MiB (about twice Gemma 3's 33 MB tokenizer.json) it is refused from its size, unread: one
    line naming the file and the bound. A .json of that size no tokenizer reads (a
    chat template list) keeps the 256 MiB bound."""
    from memtrain.models import source

    model = model_folder(tmp_path / "m", tokenizer_dir, weights=True)
    with open(model / name, "ab") as f:
        f.truncate((64 << 20) + 1)  # sparse: nothing is written
    capsys.readouterr()
    for argv in (_flags(model, corpus, tmp_path / "o"), ["estimate", "--model", str(model)]):
        assert main(argv) == 2, argv
        line = _one_error_line(capsys.readouterr().err)
        assert f"{name!r} is larger than 67,108,864 bytes" in line, line
    assert not (tmp_path / "o").exists()
    assert source._read_whole_limit(model / "additional_chat_templates" / "tokenizer.json") == 256 << 20
    assert source._read_whole_limit(model / "notes.json") == 256 << 20


@pytest.mark.parametrize("factor", [0, -1, "x"])
def test_a_rope_factor_below_one_or_no_number_is_one_line_before_building(tmp_path, capsys, factor):
    """transformers only warns of a rope_scaling factor that is no number of at least 1: a factor
    of 0 trained to a NaN loss said to need a lower --lr (exit 1), a string failed as "cannot read
    the weights", -1 trained on positions turned backwards. One line naming the field, exit 2."""
    rope = {"rope_type": "linear", "factor": factor, "rope_theta": 10000.0}
    _llama_folder_with(tmp_path, rope_scaling=rope, rope_parameters=rope)
    # (estimate's analytic figures do not depend on the factor: it answers, as for any config it reads.)
    for argv in (["generate", str(tmp_path / "m")],
                 ["train", "--model", str(tmp_path / "m"), "--steps", "1", "--out", str(tmp_path / "o")]):
        assert main(argv) == 2, argv
        line = _one_error_line(capsys.readouterr().err)
        assert f"its config.json's rope_scaling factor {factor} is not a number of at least 1" in line, line
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------ --resume compares --model by content
def test_resume_compares_the_model_folder_by_its_config_not_its_path(tokenizer_dir, corpus, tmp_path, capsys):
    """A checkpoint records its transformers --model's config.json fields: the same model moved to
    another folder resumes (its path alone was refused as another run's), and another model copied
    to the checkpoint's path (another activation: every size the run config mirrors the same) is
    refused naming the field (it resumed silently, on another model's numbers)."""
    model = model_folder(tmp_path / "m", tokenizer_dir)
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "o"
    assert main(_flags(model, corpus, out, steps=4, stop_after=2, save=str(ckpt))) == 0
    capsys.readouterr()
    moved = tmp_path / "moved"
    shutil.move(model, moved)
    assert main(_flags(moved, corpus, out, steps=4, stop_after=3, resume=str(ckpt), save=str(ckpt))) == 0, \
        capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["steps"] == 3
    capsys.readouterr()
    other = model_folder(tmp_path / "m", tokenizer_dir, activation_function="relu")  # at the checkpoint's path
    assert main(_flags(other, corpus, out, steps=4, resume=str(ckpt), save=str(ckpt))) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--model {str(model)!r} is not the model checkpoint" in line, line
    assert 'activation_function "gelu_new" -> "relu"' in line, line
    assert json.loads((out / "result.json").read_text())["steps"] == 3  # nothing lost


# ------------------------------------------------------------------------------ config.json fields a family has no setting of
def _llama_copy(llama_dir: Path, folder: Path, edit) -> Path:
    shutil.copytree(llama_dir, folder)
    config = folder / "config.json"
    config.write_text(json.dumps(edit(json.loads(config.read_text()))))
    return folder


def test_a_sliding_window_on_a_family_without_one_is_left_out_and_said(llama_dir, corpus, tmp_path, capsys):
    """transformers keeps a Llama config.json's sliding_window as an attribute: its layers ignore it,
    but generate's cache read it and kept only the last 8 keys, while training and the estimate
    attended over every key; and train took --window on such a Llama (training without one) where
    estimate refused it. memtrain leaves the field out, says so in one warning line, and refuses
    --window as estimate does; the cache then keeps every key, as the estimate counts."""
    from memtrain.models.auto_config import load_config
    from memtrain.runtime.notices import ConfigFieldWarning

    model = _llama_copy(llama_dir, tmp_path / "m", lambda c: {**c, "sliding_window": 8})
    out = tmp_path / "o"
    with pytest.warns(ConfigFieldWarning, match="config.json's sliding_window 8 is no llama setting"):
        assert main(["train", "--model", str(model), "--window", "4", *cli_flags({**RUN, "data": str(corpus),
                                                                                   "out": str(out)})]) == 2
    assert not out.exists()
    cache = transformers.DynamicCache(config=load_config(str(model)))
    assert not any(layer.is_sliding for layer in cache.layers)
    capsys.readouterr()
    assert main(["estimate", "--model", str(model), "--mode", "inference", "--seq-len", "16", "--new-tokens", "16",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache_window"] is None


def test_a_misspelt_config_field_is_named_with_the_field_it_resembles(llama_dir, tmp_path):
    """num_hiden_layers: transformers keeps it, ignores it, and builds its default 32 layers: one
    warning line names the field meant and the default it leaves."""
    from memtrain.models.auto_config import load_config
    from memtrain.runtime.notices import ConfigFieldWarning

    def misspelt(c):
        c["num_hiden_layers"] = c.pop("num_hidden_layers")
        return c

    model = _llama_copy(llama_dir, tmp_path / "m", misspelt)
    with pytest.warns(ConfigFieldWarning, match="num_hiden_layers is no llama setting .*num_hidden_layers keeps its "
                                                "default 32.*did you mean num_hidden_layers"):
        assert load_config(str(model)).num_hidden_layers == 32
    with warnings.catch_warnings():  # a field spelt right, or one of another name, is no warning
        warnings.simplefilter("error", ConfigFieldWarning)
        load_config(str(_llama_copy(llama_dir, tmp_path / "ok", lambda c: {**c, "my_note": "x"})))


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "[1, 2]", "{not json"])
def test_a_garbled_generation_config_json_is_named_by_train_and_generate(tokenizer_dir, corpus, tmp_path, capsys, text):
    """transformers reads generation_config.json while it loads the weights: a garbled one was said
    as "cannot read the weights of --model DIR (RecursionError ...); its *.safetensors files must be
    complete", the wrong file. It is checked with config.json, before the weights."""
    model = model_folder(tmp_path / "m", tokenizer_dir, weights=True)
    (model / "generation_config.json").write_text(text)
    capsys.readouterr()
    for argv in (_flags(model, corpus, tmp_path / "o"), ["generate", str(model), "--max-new-tokens", "1"]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "generation_config.json" in line and "safetensors" not in line, line
    assert not (tmp_path / "o").exists()
