"""train names the local files --data reads and warns when a folder holds one data set in several formats."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memtrain.cli import main
from memtrain.data.sources import decimal_size, files_summary, local_data_lines, same_data_warning


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))


def _posts(n: int = 60) -> list[dict]:
    return [{"text": f"Post {i}: how do I read a file line by line in Python? " * 3} for i in range(n)]


def _same_posts_three_ways(folder: Path) -> Path:
    """The same posts as .jsonl, .json and .parquet: the folder a user exports one data set into."""
    folder.mkdir()
    posts = _posts()
    (folder / "posts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in posts))
    (folder / "posts.json").write_text(json.dumps(posts))
    pq.write_table(pa.table({"text": [p["text"] for p in posts]}), folder / "posts.parquet")
    return folder


def test_summary_counts_each_kind_and_the_size(tmp_path: Path) -> None:
    folder = _same_posts_three_ways(tmp_path / "d")
    files = sorted(folder.iterdir())
    size = sum(p.stat().st_size for p in files)
    assert files_summary(files) == f"data: 3 files (1 .json, 1 .jsonl, 1 .parquet), {size / 1e3:.1f} kB"
    assert files_summary(files[:1]) == f"data: 1 file (1 .json), {files[0].stat().st_size / 1e3:.1f} kB"


def test_summary_sizes_a_small_file_in_its_own_unit_not_as_zero_mb(tmp_path: Path) -> None:
    """A chat file of a few records printed as ``0.0 MB``, which reads as empty."""
    small, large = tmp_path / "chat.jsonl", tmp_path / "big.txt"
    small.write_bytes(b"x" * 1400)
    large.write_bytes(b"x" * 2_100_000)
    assert files_summary([small]) == "data: 1 file (1 .jsonl), 1.4 kB"
    assert files_summary([large]).endswith(", 2.1 MB")
    assert [decimal_size(n) for n in (0, 999, 1000, 999_949, 3_200_000_000)] == ["0 B", "999 B", "1.0 kB", "999.9 kB",
                                                                                  "3.2 GB"]


def test_same_name_in_two_formats_warns_and_other_names_do_not(tmp_path: Path) -> None:
    folder = _same_posts_three_ways(tmp_path / "d")
    warning = same_data_warning(sorted(folder.iterdir()))
    assert warning is not None and warning.startswith("warning: ") and "\n" not in warning
    assert ".json, .jsonl, .parquet" in warning and "same data twice" in warning
    other = tmp_path / "e"
    other.mkdir()
    for name in ("a.jsonl", "b.parquet", "sub.txt"):
        (other / name).write_text("x\n")
    (other / "sub").mkdir()
    (other / "sub" / "a.txt").write_text("x\n")  # same stem, other folder: not the same file written twice
    assert same_data_warning(sorted(p for p in other.rglob("*") if p.is_file())) is None


def test_no_lines_for_default_hf_or_a_bad_path(tmp_path: Path) -> None:
    assert local_data_lines("default") == [] and local_data_lines(f"hf:{tmp_path}") == []
    assert local_data_lines(str(tmp_path / "missing.jsonl")) == []  # the run's own check says so


def test_train_prints_the_files_and_warns_once_but_still_trains(tmp_path: Path, capsys) -> None:
    from conftest import TINY_MODEL

    folder = _same_posts_three_ways(tmp_path / "d")
    flags = [x for k, v in TINY_MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]
    code = main(["train", "--data", str(folder), "--steps", "2", "--batch-size", "1", "--seq-len", "16",
                 "--val-blocks", "1", "--no-progress", "--out", str(tmp_path / "r"), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("data: 3 files (1 .json, 1 .jsonl, 1 .parquet)") == 1
    assert err.count("likely the same data twice") == 1
