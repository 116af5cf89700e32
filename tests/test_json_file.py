"""memtrain.files.json_file.read_json_file: the one reader of a JSON file read whole (result.json,
a cache entry's meta.json, a model's config.json, a saved dataset's JSON). A file is checked with
stat before it is opened, bounded by its size, parsed once; each problem says what it is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from memtrain.files import json_file
from memtrain.files.json_file import JsonFileProblem, read_json_file


def test_a_json_file_within_its_bound_is_read(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"steps": 3, "ids": [1, 2]}))
    assert read_json_file(path, 1000) == {"steps": 3, "ids": [1, 2]}
    assert read_json_file(path, None, root=tmp_path) == {"steps": 3, "ids": [1, 2]}


def test_a_fifo_or_a_file_past_the_bound_is_refused_without_being_opened(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening a FIFO blocks until a writer comes; reading a sparse 1 GiB file fills memory: both
    are said from stat, and nothing is read."""
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"{self} was opened"))
    fifo = tmp_path / "meta.json"
    os.mkfifo(fifo)
    for root in (None, tmp_path):
        with pytest.raises(JsonFileProblem, match="a FIFO, not a regular file") as seen:
            read_json_file(fifo, 1 << 20, root=root)
        assert seen.value.kind == json_file.NOT_A_FILE
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(2 << 20)  # sparse: 2 MiB of size, no data
    with pytest.raises(JsonFileProblem, match="larger than 1,048,576 bytes") as seen:
        read_json_file(big, 1 << 20)
    assert seen.value.kind == json_file.TOO_BIG


def test_a_link_out_of_the_root_is_refused_only_with_a_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (tmp_path / "d").mkdir()
    link = tmp_path / "d" / "state.json"
    link.symlink_to(outside)
    assert read_json_file(link, 100) == {}
    with pytest.raises(JsonFileProblem) as seen:
        read_json_file(link, 100, root=tmp_path / "d")
    assert seen.value.kind == json_file.NOT_A_FILE


@pytest.mark.parametrize("raw, kind", [
    (b'{"a": "\xff"}', json_file.NOT_UTF8),
    (b"[" * 100_000, json_file.NOT_JSON),  # refused by the bounded parse's depth scan, no RecursionError
    (b'{"n": 1' + b"0" * 400 + b"}", json_file.NOT_JSON),  # a 400-digit integer
    (b'{"x": NaN}', json_file.NOT_JSON),
    (b"{", json_file.NOT_JSON),
])
def test_what_the_parse_cannot_read_is_one_problem(tmp_path: Path, raw: bytes, kind: str) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(raw)
    with pytest.raises(JsonFileProblem) as seen:
        read_json_file(path, 1 << 20)
    assert seen.value.kind == kind


def test_pythons_json_reads_what_the_bounded_parse_refuses_and_a_deep_file_is_still_a_problem(tmp_path: Path) -> None:
    """A tokenizer config's 31-digit model_max_length reads with bounded=False; 100,000 levels of
    nesting are still a problem (Python's RecursionError), never a crash."""
    path = tmp_path / "tokenizer_config.json"
    path.write_text('{"model_max_length": 1000000000000000019884624838656}')
    assert read_json_file(path, None, bounded=False)["model_max_length"] == 1000000000000000019884624838656
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(JsonFileProblem) as seen:
        read_json_file(path, None, bounded=False)
    assert seen.value.kind == json_file.NOT_JSON
