"""--val-data and --val-split: a validation source of its own beside --data.

All of --data trains and validation reads the other source (ids checked against GPT-2's own
encoding of each file), each source's tokens are cached once (tokenizer calls counted), the
checkpoint's data fingerprint covers the validation text (--resume refuses other text), and bad
input is one error line with exit 2 before anything is written.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TINY_MODEL, cli_flags  # noqa: E402
from memtrain.cli import main  # noqa: E402
from memtrain.config.run import ConfigError, build_config  # noqa: E402
from test_chat_data import CHATML, CONVERSATIONS  # noqa: E402

RUN = {**TINY_MODEL, "seq_len": 16, "batch_size": 2, "steps": 2, "warmup_steps": 1, "val_blocks": 3,
       "warmup_timing_steps": 1, "progress": False}
# Two vocabularies with no word in common: a block of one file's ids holds none of the other's.
TRAIN_WORDS = "memory gradient tensor batch layer attention optimizer checkpoint".split()
VAL_WORDS = "river mountain forest valley meadow glacier canyon desert".split()


def _texts(words: list[str], n: int) -> list[str]:
    return [" ".join(words[(i + j * 3) % len(words)] for j in range(30 + i % 7)) + "." for i in range(n)]


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def _gpt2_stream(texts: list[str]) -> list[int]:
    """GPT-2's ids of each text followed by end-of-text: what a whole source's tokens must be."""
    from memtrain.data.tokenizer import EOT_ID, get_tokenizer

    enc = get_tokenizer()
    return [i for t in texts for i in [*enc.encode_ordinary(t), EOT_ID]]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def files(tmp_path) -> dict:
    train, val = _texts(TRAIN_WORDS, 80), _texts(VAL_WORDS, 12)
    return {"train": _jsonl(tmp_path / "train.jsonl", train), "val": _jsonl(tmp_path / "val.jsonl", val),
            "train_texts": train, "val_texts": val}


def test_all_of_data_trains_and_validation_reads_the_val_file_only(files, tmp_path, monkeypatch):
    """The ids train() hands the training loader are GPT-2's ids of every train.jsonl document (none
    held out), those it builds the validation batches from are val.jsonl's, and result.json names the
    validation source."""
    from memtrain.training import train as train_mod

    seen: dict[str, np.ndarray] = {}
    real_loader, real_val = train_mod.make_train_loader, train_mod.make_val_batches
    monkeypatch.setattr(train_mod, "make_train_loader",
                        lambda tokens, *a, **kw: (seen.setdefault("train", np.asarray(tokens)), real_loader(tokens, *a, **kw))[1])
    monkeypatch.setattr(train_mod, "make_val_batches",
                        lambda tokens, *a, **kw: (seen.setdefault("val", np.asarray(tokens)), real_val(tokens, *a, **kw))[1])
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "val_data": str(files["val"]), "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 0
    assert seen["train"].tolist() == _gpt2_stream(files["train_texts"])
    assert seen["val"].tolist() == _gpt2_stream(files["val_texts"])
    result = json.loads((out / "result.json").read_text())
    d = result["data"]
    assert d["train_documents"] == 80 and d["val_documents"] == 12
    assert d["val_tokens"] == len(seen["val"]) and d["val_source"] == f"--val-data {files['val']}"
    assert result["config"]["data"]["val_data"] == str(files["val"])


def test_each_sources_tokens_are_cached_once(files, tmp_path, monkeypatch):
    """A second run with the same validation file and other training data tokenizes only the new
    training file; the same pair again tokenizes nothing. Counted at the encoder."""
    from memtrain.config.run import DataConfig
    from memtrain.data import cache, prepare_splits

    encoded: list[int] = []
    real = cache._encode_documents
    monkeypatch.setattr(cache, "_encode_documents", lambda enc, docs, dtype: (encoded.append(len(docs)), real(enc, docs, dtype))[1])
    other = _jsonl(tmp_path / "other.jsonl", _texts(TRAIN_WORDS[::-1], 30))
    cache_dir = str(tmp_path / "cache")
    monkeypatch.delenv("MEMTRAIN_CACHE")

    first = prepare_splits(DataConfig(data=str(files["train"]), val_data=str(files["val"]), cache_dir=cache_dir))
    assert sum(encoded) == 80 + 12 and not first.from_cache
    encoded.clear()
    second = prepare_splits(DataConfig(data=str(other), val_data=str(files["val"]), cache_dir=cache_dir))
    assert sum(encoded) == 30 and second.val.tolist() == first.val.tolist()
    encoded.clear()
    again = prepare_splits(DataConfig(data=str(files["train"]), val_data=str(files["val"]), cache_dir=cache_dir))
    assert encoded == [] and again.from_cache and again.train.tolist() == first.train.tolist()
    # The held-out split of the same file is another entry: its tokens differ (a share is missing).
    held = prepare_splits(DataConfig(data=str(files["train"]), cache_dir=cache_dir))
    assert sum(encoded) == 80 and len(held.train) < len(first.train)


def test_resume_refuses_other_validation_text_and_another_val_data(files, tmp_path, capsys):
    """The checkpoint's fingerprint covers --val-data: the same path with other content is refused
    naming it, as other --data content is; another --val-data path is a changed setting."""
    val = files["val"]
    run = {**RUN, "data": str(files["train"]), "val_data": str(val), "steps": 4, "stop_after": 2,
           "save": str(tmp_path / "half.pt"), "out": str(tmp_path / "half")}
    assert main(["train", *cli_flags(run)]) == 0
    resumed = {**{k: v for k, v in run.items() if k not in ("stop_after", "save")},
               "resume": str(tmp_path / "half.pt"), "out": str(tmp_path / "r")}
    original = val.read_text()
    val.write_text("\n".join(reversed(original.splitlines())) + "\n")  # same path, same size, other order
    capsys.readouterr()
    assert main(["train", *cli_flags(resumed)]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"--val-data {val}" in err and "do not hold the data" in err and not (tmp_path / "r").exists()

    val.write_text(original)
    moved = shutil.copy(val, tmp_path / "val2.jsonl")
    assert main(["train", *cli_flags({**resumed, "val_data": str(moved)})]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "val_data" in err and "does not fit this run" in err
    assert main(["train", *cli_flags(resumed)]) == 0  # the checkpoint's own data resumes


@pytest.mark.parametrize("extra, says", [
    ({"val_fraction": 0.2}, "--val-fraction 0.2 splits --data into train and validation"),
    ({"split_seed": 7}, "--split-seed 7 splits --data"),
    ({"val_split": "test"}, "--val-split test picks a split of an hf: validation source"),
    ({"val_data": " "}, "--val-data is empty"),
])
def test_settings_that_cannot_go_with_val_data_are_one_line(files, tmp_path, capsys, extra, says):
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "val_data": str(files["val"]), "out": str(out), **extra}
    assert main(["train", *cli_flags(run)]) == 2
    assert says in _one_error_line(capsys.readouterr().err) and not out.exists()


@pytest.mark.parametrize("flag, says", [
    ("--val-data", "--val-data is empty; give a file, a folder, a glob, 'default' or hf:NAME, or drop --val-data"),
    ("--val-split", "--val-split is empty; give a split name (validation, test) or drop --val-split"),
    ("--data", "--data is empty; give a file, a folder, a glob, 'default' or hf:NAME"),
])
def test_an_empty_source_flag_is_refused_not_read_as_unset(files, tmp_path, capsys, flag, says):
    """``--val-data ""`` (a shell variable never set) was read as no --val-data: the run validated
    on a share of --data without a word. It is refused in one line, as ``--data ""`` is, and as a
    config file's empty string; "none" still says unset."""
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "out": str(out)}
    assert main(["train", *cli_flags(run), flag, ""]) == 2
    assert _one_error_line(capsys.readouterr().err) == f"error: {says}"
    assert not out.exists()
    key = flag[2:].replace("-", "_")
    with pytest.raises(ConfigError, match=f"{flag} is empty"):
        build_config({key: ""})
    assert build_config({"val_data": "none"}).data.val_data is None
    with pytest.raises(ConfigError, match="--chat-template is empty"):  # the other source-like setting
        build_config({"data": "x.jsonl", "data_format": "chat", "chat_template": ""})


@pytest.mark.parametrize("flag, says", [
    ("--save", "--save is empty; give a file path or drop --save"),
    ("--resume", "--resume is empty; give a checkpoint path or drop --resume"),
])
def test_an_empty_checkpoint_path_is_refused_not_read_as_unset(files, tmp_path, capsys, flag, says):
    """``--save ""`` was read as no --save (the run saved nothing, silently) and ``--resume ""`` as
    no --resume (it trained from scratch): both are one line now, on the command line and in a
    config file; "none" still says unset."""
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "out": str(out)}
    assert main(["train", *cli_flags(run), flag, ""]) == 2
    assert _one_error_line(capsys.readouterr().err) == f"error: {says}"
    assert not out.exists()
    key = flag[2:]
    with pytest.raises(ConfigError, match=f"{flag} is empty"):
        build_config({key: ""})
    assert getattr(build_config({key: "none"}).train, key) is None


def test_the_default_val_fraction_spelled_out_beside_val_data_is_taken():
    """A config file may spell every key: the default --val-fraction asks for no split."""
    cfg = build_config({"val_data": "v.jsonl", "val_fraction": 0.05, "split_seed": 1234})
    assert cfg.data.validation_config() is not None
    with pytest.raises(ConfigError, match="drop --val-fraction"):
        build_config({"val_data": "v.jsonl", "val_fraction": 0.1})


@pytest.mark.parametrize("content, says", [
    (None, "no file matches"),
    ("", "is empty (0 bytes); check --val-data"),
    ('{"text": ""}\n{"text": "  "}\n', "holds no documents"),
    ('{"text": "a few words."}\n', "has 5 tokens, fewer than one validation block needs (17: --seq-len 16 + 1)"),
])
def test_a_missing_empty_or_short_val_file_is_one_line_naming_it(files, tmp_path, capsys, content, says):
    val = tmp_path / "v.jsonl"
    if content is not None:
        val.write_text(content)
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "val_data": str(val), "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert says in err and str(val) in err and " --data " not in err, err
    assert not out.exists()


def test_the_training_file_as_val_data_warns_and_runs(files, tmp_path, capsys):
    out = tmp_path / "run"
    spelled = files["train"].parent / "." / files["train"].name  # another spelling of the same file
    run = {**RUN, "data": str(files["train"]), "val_data": str(spelled), "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "memorisation" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: --val-data")
    assert (out / "result.json").is_file()


def test_val_split_validates_on_another_split_of_a_saved_dataset(files, tmp_path):
    """--val-split of an hf: --data folder (datasets' save_to_disk of a DatasetDict) trains on all of
    --hf-split and validates on the named split."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "dsd"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"text": t} for t in files["train_texts"]]),
        "validation": datasets.Dataset.from_list([{"text": t} for t in files["val_texts"]]),
    }).save_to_disk(str(folder))
    from memtrain.config.run import DataConfig
    from memtrain.data import prepare_splits

    splits = prepare_splits(DataConfig(data=f"hf:{folder}", val_split="validation"))
    assert splits.train.tolist() == _gpt2_stream(files["train_texts"])
    assert splits.val.tolist() == _gpt2_stream(files["val_texts"])
    with pytest.raises(ConfigError, match="--val-split validation picks a split of an hf: validation source"):
        DataConfig(data=str(files["train"]), val_split="validation")


def test_chat_records_in_the_val_file_train_on_answers_only(tmp_path, capsys):
    """--loss-on completion reads the validation file's chat records with the same template: its
    targets are the assistant turns (decoded: every answer, no question) and val loss averages them."""
    from memtrain.config.run import DataConfig
    from memtrain.data import prepare_splits
    from memtrain.data.tokenizer import get_tokenizer

    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    train = _jsonl(tmp_path / "unused.jsonl", [])
    train.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS[:48]))
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS[48:]))
    chat = {"data_format": "chat", "loss_on": "completion", "chat_template": str(template)}
    splits = prepare_splits(DataConfig(data=str(train), val_data=str(val), **chat),
                            tokenizer=_gpt_chat_tokenizer(tmp_path, template))
    ids, mask = np.asarray(splits.val), np.asarray(splits.val_mask)
    answers = get_tokenizer().decode(ids[mask == 1].tolist())
    assert splits.n_val_docs == 12 and 0 < mask.sum() < len(mask)
    assert "Use sorted(x49)" in answers and "How do I sort list" not in answers

    out = tmp_path / "run"
    # Blocks of 64 tokens: the first conversation's system turn alone fills a block of 16.
    run = {**RUN, "data": str(train), "val_data": str(val), "out": str(out), "seq_len": 64, **chat}
    assert main(["train", *cli_flags(run)]) == 0
    d = json.loads((out / "result.json").read_text())["data"]
    assert 0 < d["val_target_tokens_evaluated"] < d["val_tokens_evaluated"]
    assert f"answer tokens of {d['val_tokens_evaluated']:,} of the {d['val_tokens']:,} tokens of --val-data" in (
        capsys.readouterr().out)


def _gpt_chat_tokenizer(tmp_path: Path, template: Path):
    """The tokenizer train gives our GPT's chat data (GPT-2's BPE with the --chat-template)."""
    from memtrain.models.families import data_tokenizer

    cfg = build_config({"data": str(tmp_path / "x.jsonl"), "data_format": "chat", "chat_template": str(template)})
    return data_tokenizer(cfg)


def test_the_bench_report_says_what_val_ppl_was_read_on():
    """report.md names the rows' validation source (result.json's data.val_source); rows written
    before it carry none and their report says nothing of it."""
    from memtrain.report.tables import markdown_report
    from test_report_recommend import ROWS

    rows = [{**r, "data": {"val_source": "--val-data val.jsonl"}} for r in ROWS[:2]]
    assert "Val PPL read on `--val-data val.jsonl`." in markdown_report(rows, [])
    assert "Val PPL read on" not in markdown_report(ROWS[:2], [])


def test_bench_refuses_a_missing_val_file_before_its_folder_exists(files, tmp_path, capsys):
    """bench takes --val-data as train does (each row's config carries it); a file that is not there
    is train's one line, said before the bench's folder, lock or first row exists."""
    out = tmp_path / "bench"
    missing = tmp_path / "nope.jsonl"
    assert main(["bench", "--techniques", "baseline", "--data", str(files["train"]), "--val-data", str(missing),
                 "--no-maxbatch", "--out", str(out)]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert str(missing) in err and "--val-data" in err and not out.exists()


def test_a_relative_val_data_resumes_from_another_folder(files, tmp_path, monkeypatch):
    """--resume CKPT alone from another folder reads the run's own relative --val-data (anchored at
    the folder the run was launched from, as --data is), not a val.jsonl beside the new folder."""
    monkeypatch.chdir(files["val"].parent)
    run = {**RUN, "data": files["train"].name, "val_data": files["val"].name, "steps": 3, "stop_after": 2,
           "save": str(tmp_path / "half" / "ck.pt"), "out": str(tmp_path / "half")}
    assert main(["train", *cli_flags(run)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", str(tmp_path / "half" / "ck.pt")]) == 0
    result = json.loads((tmp_path / "half" / "result.json").read_text())
    assert result["steps"] == 3 and result["config"]["data"]["val_data"] == str(files["val"])


def test_packing_pad_makes_a_row_of_each_val_file_record(files, tmp_path, monkeypatch):
    """--packing pad beside --val-data: the validation rows are val.jsonl's records, one each, cut at
    the source's own record offsets (the whole entry's ``train`` offsets, carried over as ``val``)."""
    from memtrain.training import train as train_mod

    seen: dict[str, object] = {}
    real_val = train_mod.make_val_batches
    monkeypatch.setattr(train_mod, "make_val_batches",
                        lambda tokens, *a, **kw: (seen.setdefault("offsets", kw.get("offsets")), real_val(tokens, *a, **kw))[1])
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "val_data": str(files["val"]), "packing": "pad", "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 0
    offsets = np.asarray(seen["offsets"])
    lengths = [len(_gpt2_stream([t])) for t in files["val_texts"]]
    assert offsets.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    result = json.loads((out / "result.json").read_text())
    assert result["padding"]["val_targets_evaluated"] == sum(min(n, RUN["seq_len"] + 1) - 1
                                                            for n in lengths[:RUN["val_blocks"]])


@pytest.mark.parametrize("val_data, says", [
    ("hf:nosuch/name", "cannot reach the Hugging Face Hub for 'nosuch/name'"),
    ("{tmp}/missing.jsonl", "no file matches"),
])
def test_an_unreadable_val_source_is_refused_before_data_is_tokenized(files, tmp_path, capsys, monkeypatch,
                                                                      val_data, says):
    """A --val-data that cannot be read (a Hub name while the Hub is unreachable, a path that is not
    there) is the run's one error line before a single --data document is tokenized: on a large
    corpus that is minutes saved. Counted at the encoder; the Hub is faked (no connection opened)."""
    from memtrain.data import cache, sources

    encoded: list[int] = []
    real_encode, real_load = cache._encode_documents, sources._load_dataset
    monkeypatch.setattr(cache, "_encode_documents",
                        lambda enc, docs, dtype: (encoded.append(len(docs)), real_encode(enc, docs, dtype))[1])

    def unreachable_hub(path: str, *, split: str, label: str, hub: bool = False, **kwargs):
        if hub:  # what _load_dataset says of a Hub it cannot reach
            raise ConfigError(sources._hub_unreachable(label, ConnectionError("no network")))
        return real_load(path, split=split, label=label, **kwargs)

    monkeypatch.setattr(sources, "_load_dataset", unreachable_hub)
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "val_data": val_data.format(tmp=tmp_path), "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert says in err and "--val-data" in err, err
    assert encoded == []  # not one document of --data was tokenized
    assert not out.exists()


def test_packing_pad_counts_the_val_records_longer_than_a_row(files, tmp_path, capsys):
    """--packing pad: the one note line says how many --val-data records were cut at a row (and how
    many of the rows val_loss is read on), beside the training records' count; result.json's
    padding adds the validation split's counts under val_ keys."""
    texts = [t if i % 3 == 0 else " ".join(t.split()[:3]) for i, t in enumerate(files["val_texts"])]
    val = _jsonl(tmp_path / "mixed.jsonl", texts)
    lengths = [len(_gpt2_stream([t])) for t in texts]
    row = RUN["seq_len"] + 1
    longer, evaluated_longer = sum(n > row for n in lengths), sum(n > row for n in lengths[:RUN["val_blocks"]])
    assert 0 < longer < len(texts) and evaluated_longer == 1  # the data holds what the test is about
    out = tmp_path / "run"
    run = {**RUN, "data": str(files["train"]), "val_data": str(val), "packing": "pad", "out": str(out)}
    assert main(["train", *cli_flags(run)]) == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: --packing pad")]
    assert len(lines) == 1, lines
    assert (f"{longer} of {len(texts)} validation records are longer than a row and were truncated "
            f"({evaluated_longer} of the {RUN['val_blocks']} rows val_loss is read on)") in lines[0], lines[0]
    assert "training records are longer than a row (--seq-len + 1 = 17 tokens)" in lines[0]
    padding = json.loads((out / "result.json").read_text())["padding"]
    assert padding["val_truncated_records"] == longer and padding["val_skipped_records"] == 0
    assert padding["val_truncated_evaluated"] == evaluated_longer
    assert padding["truncated_records"] == sum(len(_gpt2_stream([t])) > row for t in files["train_texts"])
