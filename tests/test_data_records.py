"""Data records as a fine-tuner brings them: instruction and chat records refused saying what
memtrain trains on, a text field that is one part of a record warned once, a datasets
save_to_disk folder read as the same records in a file, and one whose JSON is garbled or points
outside it refused in one line."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main

TINY_FLAGS = [*cli_flags(TINY_MODEL), "--batch-size", "1", "--seq-len", "16", "--val-blocks", "1", "--warmup-steps", "1",
              "--no-progress"]


@pytest.mark.parametrize("record, field", [
    ({"prompt": "How do I sort a list?", "response": "Use sorted()."}, None),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}, "messages"),
])
def test_instruction_and_chat_records_are_refused_saying_what_memtrain_trains_on(tmp_path, capsys, record, field):
    """Naming a prompt field would train on prompts alone and a messages list is no text: the one
    error line names --data-format for chat and prompt-completion records, how to make a text field
    of other instruction records, and writes nothing."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for _ in range(20)))
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), "--steps", "1", "--seq-len", "16", "--batch-size", "1", "--out", str(out)]
    assert main([*argv, *(["--text-field", field] if field else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "--data-format chat" in err and "--data-format prompt-completion" in err and "--text-field" in err
    assert not out.exists()


def test_a_text_field_named_like_none_of_those_gets_no_instruction_hint(tmp_path, capsys):
    data = tmp_path / "posts.jsonl"
    data.write_text("".join(json.dumps({"body": "a post"}) + "\n" for _ in range(20)))
    assert main(["train", "--data", str(data), "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "field 'text' not found" in err and "--data-format" not in err


def test_a_text_field_that_is_one_part_of_an_instruction_record_is_warned_once(tmp_path, capsys):
    """--text-field instruction trains on the instructions alone: the run goes on, saying so in one line."""
    from memtrain.config.run import build_config
    from memtrain.data import prepare_tokens
    from memtrain.runtime.notices import PartOfARecordWarning

    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Sort list {i}", "output": "sorted(x)"}) + "\n"
                            for i in range(20)))
    cfg = build_config({"data": str(data), "text_field": "instruction", "cache_dir": str(tmp_path / "cache")})
    with pytest.warns(PartOfARecordWarning, match="trains on that field alone; the records also hold output") as seen:
        prepare_tokens(cfg.data, progress=False)
    assert len(seen) == 1


def test_a_save_to_disk_folder_reads_as_the_same_records_in_a_file(small_corpus, tmp_path, capsys):
    """datasets' save_to_disk (a Dataset, or a DatasetDict's split) is read with load_from_disk
    through hf:DIR, giving the tokens of the same records in a .jsonl; the folder given without
    hf: is one line saying to add it, and a split the DatasetDict lacks names the ones it has."""
    datasets = pytest.importorskip("datasets")
    from memtrain.config.run import ConfigError, build_config
    from memtrain.data import prepare_tokens

    records = [json.loads(line) for line in small_corpus.read_text().splitlines()]
    one, both = tmp_path / "one", tmp_path / "both"
    datasets.Dataset.from_list(records).save_to_disk(str(one))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(both))

    def tokens(data: str, **kw) -> np.ndarray:
        cfg = build_config({"data": data, "cache_dir": str(tmp_path / "cache"), **kw})
        return np.asarray(prepare_tokens(cfg.data, progress=False).train)

    expected = tokens(str(small_corpus))
    assert np.array_equal(tokens(f"hf:{one}"), expected)
    assert np.array_equal(tokens(f"hf:{both}"), expected)
    with pytest.raises(ConfigError, match=r"has no split 'validation' \(splits: train\); set --hf-split"):
        tokens(f"hf:{both}", hf_split="validation")
    capsys.readouterr()  # save_to_disk's progress bars
    assert main(["train", "--data", str(one), "--steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --data {str(one)!r} is a folder written by datasets' save_to_disk; give --data hf:{one}\n"


def test_a_save_to_disk_folder_with_garbled_or_outward_json_is_one_line(small_corpus, tmp_path, capsys):
    """A save_to_disk folder whose dataset_info.json is a list, whose state.json lists files as
    numbers, or whose state.json names a file outside it (`../good/data.arrow`, which datasets read):
    datasets' AttributeError or TypeError (exit 1), or a read outside the folder. Each is one
    line (exit 2) before datasets reads the folder; the folder as saved still reads."""
    datasets = pytest.importorskip("datasets")

    records = [json.loads(line) for line in small_corpus.read_text().splitlines()]
    good = tmp_path / "good"
    datasets.Dataset.from_list(records).save_to_disk(str(good))
    state = json.loads((good / "state.json").read_text())
    outward = f"../good/{state['_data_files'][0]['filename']}"
    capsys.readouterr()  # save_to_disk's progress bars
    for name, edit in (("info-list", {"dataset_info.json": "[1]"}),
                       ("files-numbers", {"state.json": json.dumps({**state, "_data_files": [5]})}),
                       # a file that exists outside the folder: datasets read it
                       ("outward", {"state.json": json.dumps({**state, "_data_files": [{"filename": outward}]})})):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        for file, text in edit.items():
            (folder / file).write_text(text)
        out = tmp_path / f"run-{name}"
        argv = ["train", "--data", f"hf:{folder}", "--steps", "1", "--out", str(out), *TINY_FLAGS]
        assert main(argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith(f"error: cannot load {str(folder)!r} (a save_to_disk folder): ") and err.count("\n") == 1, err
        assert not out.exists()
    assert main(["train", "--data", f"hf:{good}", "--steps", "1", "--out", str(tmp_path / "ok"), *TINY_FLAGS]) == 0
