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


def _link_in_and_out(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A folder ``d`` holding a link to a file inside it and a link to a file outside it."""
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "real.json").write_text('{"where": "inside"}')
    (tmp_path / "outside.json").write_text('{"where": "outside"}')
    (folder / "in.json").symlink_to(folder / "real.json")
    (folder / "out.json").symlink_to(tmp_path / "outside.json")
    return folder, folder / "in.json", folder / "out.json"


def test_links_are_followed_into_the_root_only_or_refused_as_the_caller_says(tmp_path: Path) -> None:
    """The follow-links policy is the caller's: a result.json or state.json reader follows a link
    that stays in its folder; the bench record (follow_links=False) reads no file through a link,
    inside the folder or out, dangling or not."""
    folder, inside, outside = _link_in_and_out(tmp_path)
    assert read_json_file(inside, 100, root=folder) == {"where": "inside"}
    with pytest.raises(JsonFileProblem, match="a symbolic link to .*outside") as seen:
        read_json_file(outside, 100, root=folder)
    assert seen.value.kind == json_file.NOT_A_FILE
    (folder / "dangling.json").symlink_to(tmp_path / "nothing.json")
    for link in (inside, outside, folder / "dangling.json"):
        with pytest.raises(JsonFileProblem, match="^a symbolic link$") as seen:
            read_json_file(link, 100, follow_links=False)
        assert seen.value.kind == json_file.LINK
    assert read_json_file(folder / "real.json", 100, follow_links=False) == {"where": "inside"}


def test_a_link_swapped_in_after_the_check_is_refused_by_the_open(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Not following links, the file is opened with O_NOFOLLOW: a link put there between the
    check and the open (here: the check is made to miss it) is refused all the same."""
    _, inside, _ = _link_in_and_out(tmp_path)
    monkeypatch.setattr(json_file, "_is_link", lambda path: False)
    monkeypatch.setattr(json_file, "_path_problem", lambda *args: None)
    with pytest.raises(JsonFileProblem) as seen:
        read_json_file(inside, 100, follow_links=False)
    assert seen.value.kind == json_file.LINK


@pytest.mark.parametrize("follow_links", [True, False])
def test_size_type_and_shape_under_either_link_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      follow_links: bool) -> None:
    """An oversized file is refused from its size (given in ``size``, for a caller that names it)
    and a FIFO from stat, neither opened; non-JSON is a problem; JSON that is not an object is
    returned as it is, for the caller to check its shape (every caller does)."""
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(5000)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "torn.json").write_text('{"a": ')
    opened: list = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(Path(path).name) or real_open(path, *a, **k))
    for path, kind in ((big, json_file.TOO_BIG), (fifo, json_file.NOT_A_FILE), (tmp_path / "torn.json", json_file.NOT_JSON)):
        with pytest.raises(JsonFileProblem) as seen:
            read_json_file(path, 1000, root=tmp_path if follow_links else None, follow_links=follow_links)
        assert seen.value.kind == kind
        assert seen.value.size == (5000 if path == big else None)
    assert read_json_file(tmp_path / "list.json", 1000, follow_links=follow_links) == [1, 2]
    assert opened == ["torn.json", "list.json"]  # the big file and the FIFO were refused unopened


def test_a_file_larger_than_its_size_says_is_read_no_further_than_the_bound(tmp_path: Path) -> None:
    """stat's size is checked first, but a file can hold more than it says (one that grew since,
    or /proc's, whose size is 0): at most the bound and one byte more is read, then it is refused
    (the whole file was read, and then parsed)."""
    proc = Path("/proc/self/maps")  # a regular file of size 0 holding kilobytes
    if not proc.is_file() or proc.stat().st_size != 0:
        pytest.skip("no /proc with size-0 files here")
    with pytest.raises(JsonFileProblem, match="grew past 100 bytes while read") as seen:
        read_json_file(proc, 100)
    assert seen.value.kind == json_file.TOO_BIG and seen.value.size is None
