"""Hostile sizes and shapes in what memtrain reads: data, configs, model shapes, checkpoints
and results. Each is refused with one ``error:`` line (exit 2) or skipped with a warning,
within seconds and bounded memory; never a crash, a hang or a RecursionError."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TINY_MODEL, cli_flags
from memtrain.cli import main
from memtrain.config.run import DataConfig

DATA = Path(__file__).parent / "data"
SRC = Path(__file__).resolve().parents[1] / "src"
RUN = {**TINY_MODEL, "seq_len": 32, "warmup_steps": 1, "val_blocks": 2, "warmup_timing_steps": 1,
       "batch_size": 2, "progress": False}


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _cli(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI in its own process: a segfault or a stack overflow shows as a signal there."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run([sys.executable, "-m", "memtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# --------------------------------------------------------------------------- the bounded parse
def test_depth_scan_agrees_with_json_on_strings_escapes_and_piece_boundaries():
    from memtrain.files.json_text import JsonDepthScan

    text = json.dumps({"a": ["[[[", {"b": "x\\\"]]{{"}], "c": [[["\\"]]], "d": "}}}"}).encode()
    true_depth = 4  # {"c": [[[ ... ]]]}
    for piece in (1, 2, 3, 5, len(text)):
        for limit, fits in ((true_depth, True), (true_depth - 1, False)):
            scan = JsonDepthScan(limit)
            assert all(scan.feed(text[i:i + piece]) for i in range(0, len(text), piece)) is fits, (piece, limit)


def test_loads_bounded_refuses_deep_long_and_non_finite_numbers():
    from memtrain.files.json_text import loads_bounded

    for hostile in (_deep(100_000), "9" * 400, "9" * 5000, "1e999", "NaN", '{"x": -Infinity}'):
        with pytest.raises(ValueError):
            loads_bounded(hostile)
    assert loads_bounded('{"a": [1, 2.5, "[[["]}') == {"a": [1, 2.5, "[[["]}


# --------------------------------------------------------------------------- 1. JSON data nested deep
def _deep_jsonl(path: Path, depth: int = 20_000) -> Path:
    good = [json.dumps({"text": f"document {i} about memory and tensors"}) for i in range(40)]
    deep = '{"text": "a", "x": ' + _deep(depth) + "}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*good, deep, *good]) + "\n")
    return path


@pytest.mark.parametrize("layout", ["jsonl", "json-array", "hf-dir", "hf-json-glob"])
def test_deeply_nested_json_data_is_refused_naming_file_and_line(tmp_path, layout):
    if layout == "json-array":  # a pretty-printed array: the depth builds up over lines
        path = tmp_path / "data.json"
        path.write_text('[{"text": "a"},\n{"text": "b", "x":\n' + "[\n" * 20_000 + "]\n" * 20_000 + "}]\n")
        data, line = str(path), 257  # line n opens level n
    else:
        path = _deep_jsonl(tmp_path / "d" / "train.jsonl")
        data = {"jsonl": str(path), "hf-dir": f"hf:{path.parent}", "hf-json-glob": f"hf:json:{path.parent}/*.jsonl"}[layout]
        line = 41
    out = tmp_path / "out"
    proc = _cli(["train", *cli_flags({**RUN, "data": data, "steps": 1, "out": str(out)})])
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = _one_error_line(proc.stderr)
    assert str(path) in err and f"line {line}" in err and "nested deeper" in err
    assert not out.exists()  # no lock or folder left behind


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("data", ["file", "hf-dir"])
def test_a_jsonl_line_too_long_for_a_record_is_refused_before_any_reader_holds_it(tmp_path, capsys, monkeypatch, data,
                                                                                    suffix):
    """A .jsonl line of 300 MiB (a sparse file) took 1.8 GB of memory before its refusal (pyarrow
    and the check naming the bad line each held it whole, several times over). Refused from the streaming pass that measures the nesting, naming the line.
    A .json file of JSON lines, which the reader reads the same way, had no limit."""
    from memtrain.data import json_records

    monkeypatch.setattr(json_records, "MAX_JSON_RECORD_BYTES", 1 << 20)  # 1 MiB: a fast test
    path = tmp_path / "d" / f"train{suffix}"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(3)))
    with open(path, "ab") as f:
        f.truncate(f.tell() + (2 << 20))  # line 4: 2 MiB of NUL bytes, sparse
    with open(path, "a") as f:
        f.write("\n" + json.dumps({"text": "after"}) + "\n")
    out = tmp_path / "out"
    given = str(path) if data == "file" else f"hf:{path.parent}"
    assert main(["train", *cli_flags({**RUN, "data": given, "steps": 1, "out": str(out)})]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{str(path)!r} line 4 is longer than 1 MiB" in err and "split it into records" in err, err
    assert not out.exists()


@pytest.mark.parametrize("data", ["file", "hf-dir"])
@pytest.mark.parametrize("layout", ["one-line", "quoted-lines"])
def test_a_csv_record_too_long_is_refused_before_its_reader_holds_it(tmp_path, capsys, monkeypatch, layout, data):
    """pandas (datasets' csv reader) held a 100 MB field whole, several times over (317 MB); a
    record is bounded as a JSON line is, on one line or spread over the lines of a quoted field."""
    from memtrain.data import json_records

    monkeypatch.setattr(json_records, "MAX_JSON_RECORD_BYTES", 1 << 20)  # 1 MiB: a fast test
    words = "word " * 20_000  # 100 KB
    rows = [f'"post {i}, a ""quoted"" word"' for i in range(3)]
    huge = {"one-line": '"' + words * 21 + '"', "quoted-lines": '"' + "\n".join([words] * 21) + '"'}[layout]
    path = tmp_path / "d" / "posts.csv"
    path.parent.mkdir()
    path.write_text("\n".join(["text", *rows, huge, '"after"']) + "\n")
    out = tmp_path / "out"
    given = str(path) if data == "file" else f"hf:{path.parent}"
    assert main(["train", *cli_flags({**RUN, "data": given, "steps": 1, "out": str(out)})]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{str(path)!r}: the record on line 5 is longer than 1 MiB" in err, err
    assert not out.exists()
    # A field just under the bound, over many lines, and a quote inside an unquoted field still read.
    path.write_text("\n".join(["text", 'a 5" screen', '"' + "\n".join([words] * 9) + '"', "after"]) + "\n")
    from memtrain.data import sources

    docs = list(sources.iter_documents(DataConfig(data=str(path))))
    assert docs[0] == 'a 5" screen' and len(docs[1]) == 9 * len(words) + 8 and docs[2] == "after"


@pytest.mark.parametrize("layout", ["one-line", "pretty", "hf-dir"])
def test_a_json_array_too_large_to_read_whole_is_refused_from_its_size(tmp_path, capsys, monkeypatch, layout):
    """datasets' json reader holds a .json array whole, several times over (64.6 MB of records
    peaked 409 MB), and a .json file had no size or line limit: an array on one line, or one
    pretty-printed over many short lines, of any size went into memory. One over the record
    limit is refused from its size, naming the limit and the JSON-lines form to write instead."""
    from memtrain.data import json_records, sources

    monkeypatch.setattr(json_records, "MAX_JSON_RECORD_BYTES", 1 << 20)  # 1 MiB: a fast test
    records = [{"text": f"document {i} about memory " * 8} for i in range(12_000)]  # ~2.6 MB
    path = tmp_path / "d" / "posts.json"
    path.parent.mkdir()
    path.write_bytes(b"\xef\xbb\xbf\n " + json.dumps(records, indent=1 if layout == "pretty" else None).encode())
    size = path.stat().st_size
    out = tmp_path / "out"
    given = f"hf:{path.parent}" if layout == "hf-dir" else str(path)
    assert main(["train", *cli_flags({**RUN, "data": given, "steps": 1, "out": str(out)})]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert f"{str(path)!r} is a JSON array of {size:,} bytes, more than memtrain reads whole (1 MiB" in err, err
    assert "jq -c '.[]' posts.json > posts.jsonl" in err, err
    assert not out.exists()
    # An array within the limit is read, records in order.
    path.write_text(json.dumps(records[:3]))
    assert list(sources.iter_documents(DataConfig(data=str(path)))) == [r["text"] for r in records[:3]]


# --------------------------------------------------------------------------- 2. one huge line
_RSS = textwrap.dedent("""
    import resource, sys
    from memtrain.config.run import DataConfig
    from memtrain.data import get_tokenizer, prepare_tokens
    get_tokenizer()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    splits = prepare_tokens(DataConfig(data=sys.argv[1], val_fraction=0.01), progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - before) * 1024, len(splits.train) + len(splits.val))
""")


def test_one_huge_line_tokenizes_in_bounded_memory(tmp_path):
    words = "memory gradient tensor batch layer attention optimizer checkpoint value error list".split()
    line = " ".join(words[(i * 7) % len(words)] + str(i % 97) for i in range(2_400_000))  # ~24 MB, one line
    path = tmp_path / "one-line.txt"
    path.write_text(line)
    env = {**os.environ, "PYTHONPATH": str(SRC), "MEMTRAIN_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _RSS, str(path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    grown, tokens = map(int, proc.stdout.split())
    # Reading the line whole and encoding it in one call grew the process by ~14x the line.
    assert grown < 6 * len(line), f"peak RSS grew by {grown / len(line):.1f}x the line's size"
    assert tokens > len(line) // 8  # every piece was tokenized
    assert not list((tmp_path / "cache").glob(".tmp-*"))  # no scratch left


def test_long_documents_are_encoded_in_pieces_with_the_same_tokens(monkeypatch):
    import numpy as np

    from memtrain.data import cache, default_documents, get_tokenizer

    tok = get_tokenizer()
    text = "\n\n".join(default_documents()[:40])  # real prose, code and tables
    monkeypatch.setattr(cache, "ENCODE_PIECE_CHARS", 2000)
    monkeypatch.setattr(cache, "BATCH_CHARS", 6000)
    pieces = []
    encode = lambda texts: (pieces.extend(texts), tok.encode_ordinary_batch(texts))[1]  # noqa: E731
    ids, = cache._encode_documents(encode, [text], np.uint16)
    assert len(pieces) > 10 and max(map(len, pieces)) <= 2000  # it was cut, into bounded pieces
    assert ids.tolist() == tok.encode_ordinary(text)


def test_a_long_line_of_a_text_file_is_read_in_pieces_cut_at_word_breaks():
    import io

    from memtrain.data.sources import _bounded_text_lines

    text = "short line\n" + " ".join(f"word{i}" for i in range(5000)) + "\nlast"
    pieces = list(_bounded_text_lines(io.StringIO(text), 1000))
    assert "".join(pieces) == text and max(map(len, pieces)) <= 1000
    assert pieces[0] == "short line\n" and all(p.startswith(" word") for p in pieces[2:-2])


_PARQUET_PEAK = textwrap.dedent("""
    import sys
    import pyarrow as pa
    from memtrain.config.run import DataConfig
    from memtrain.data.sources import iter_documents
    n = sum(1 for _ in iter_documents(DataConfig(data=sys.argv[1])))
    print(n, pa.default_memory_pool().max_memory())
""")


def test_a_parquet_row_group_that_decodes_to_gigabytes_is_read_a_few_rows_at_a_time(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # One 256 KiB text in 400 rows, dictionary-encoded and compressed: a file of a few hundred
    # bytes whose one row group decodes to 100 MiB (15,000 such rows would be 3.7 GiB).
    text = "word " * 52_429
    rows = 400
    column = pa.DictionaryArray.from_arrays(pa.array([0] * rows, pa.int32()), pa.array([text]))
    path = tmp_path / "bomb.parquet"
    pq.write_table(pa.table({"text": column}), path, compression="zstd", row_group_size=rows)
    assert path.stat().st_size < 4096
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run([sys.executable, "-c", _PARQUET_PEAK, str(path)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    documents, arrow_peak = map(int, proc.stdout.split())
    assert documents == rows  # every row read
    # pyarrow's own count of the bytes it held at once: the whole row group (122 MiB) when
    # datasets' builder read it; a batch of PARQUET_BATCH_ROWS rows now.
    decoded = rows * len(text)
    assert arrow_peak < decoded // 2, f"pyarrow held {arrow_peak >> 20} MiB at once for {decoded >> 20} MiB of rows"


def test_an_xml_dump_of_elements_other_than_rows_is_read_in_bounded_memory(tmp_path):
    """Only <row> elements were cleared: 141 MB of <post> elements held 1.5 GB. Python's own count
    of the bytes it held at once (tracemalloc) stays a fraction of the file's size now."""
    import tracemalloc

    from memtrain.data import sources

    path = tmp_path / "Posts.xml"
    post = '<post Id="1" Body="hello world, this is text"/>\n'
    path.write_text("<posts><group>" + post * 200_000 + '</group><row Body="the one row"/></posts>')
    tracemalloc.start()
    try:
        docs = list(sources.iter_documents(DataConfig(data=str(path))))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert docs == ["the one row"]
    assert peak < path.stat().st_size // 4, f"held {peak:,} bytes at once for a {path.stat().st_size:,}-byte file"


@pytest.mark.parametrize("hostile", ["attribute", "text", "dtd", "depth"])
def test_an_xml_tag_too_long_or_nesting_too_deep_is_one_line(tmp_path, capsys, monkeypatch, hostile):
    """A 1 GB Body attribute (or text, or DTD) was held whole by the parser, several times over;
    elements nested a million deep were each held open. One error: line naming the file now."""
    from memtrain.data import sources

    monkeypatch.setattr(sources, "MAX_XML_TAG_BYTES", 1 << 20)  # 1 MiB: a fast test
    rows = "".join(f'<row Body="post {i} of the dump"/>\n' for i in range(20))
    big = "x" * (3 << 20)
    body = {"attribute": f'<posts>{rows}<row Body="{big}"/></posts>',
            "text": f"<posts>{rows}{big}</posts>",
            "dtd": f'<!DOCTYPE posts [<!ENTITY e "{big}">]><posts>{rows}</posts>',
            "depth": f"<posts>{rows}" + "<a>" * 300 + "</a>" * 300 + "</posts>"}[hostile]
    path = tmp_path / "Posts.xml"
    path.write_text(body)
    out = tmp_path / "out"
    assert main(["train", *cli_flags({**RUN, "data": str(path), "steps": 1, "out": str(out)})]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert str(path) in err and ("deeper than 256" if hostile == "depth" else "longer than 1 MiB") in err, err
    assert not out.exists()


# --------------------------------------------------------------------------- 3. absurd model sizes
@pytest.mark.parametrize("flags", [
    {"n_layers": 10**9}, {"d_ff": 10**12}, {"vocab_size": 10**12}, {"max_seq_len": 10**10},
    {"d_model": 65536, "n_heads": 8, "n_layers": 200},  # within the limits, 13 TB of parameters
])
def test_train_refuses_a_model_that_cannot_be_built_before_building(tmp_path, capsys, flags):
    out = tmp_path / "out"
    start = time.monotonic()
    assert main(["train", *cli_flags({**RUN, **flags, "data": "default", "steps": 1, "out": str(out)})]) == 2
    assert time.monotonic() - start < 60  # seconds, not minutes of building layers
    err = _one_error_line(capsys.readouterr().err)
    assert "beyond what memtrain builds" in err or "more than this machine's" in err
    assert not out.exists()


def _hf_config(tmp_path: Path, name: str, **changes) -> Path:
    src = SRC / "memtrain" / "models" / "configs" / f"{name}.json"
    cfg = {**json.loads(src.read_text()), **changes}
    d = tmp_path / f"{name}-{len(changes)}-{abs(hash(str(changes)))}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("name, changes", [
    ("tiny-llama", {"num_hidden_layers": 10**9}), ("tiny-llama", {"hidden_size": 10**12}),
    ("tiny-llama", {"vocab_size": 10**12}), ("tiny-llama", {"intermediate_size": 10**12}),
    ("tiny-gpt2", {"n_layer": 10**9}),
])
def test_train_refuses_an_absurd_transformers_config(tmp_path, capsys, name, changes):
    d = _hf_config(tmp_path, name, **changes)
    out = tmp_path / "out"
    flags = {"model": str(d / "config.json"), "seq_len": 8, "batch_size": 1, "steps": 1, "progress": False,
             "out": str(out)}
    assert main(["train", *cli_flags(flags)]) == 2
    assert "beyond what memtrain builds" in _one_error_line(capsys.readouterr().err)
    assert not out.exists()


def test_generate_refuses_an_exported_folder_of_absurd_depth(tmp_path, capsys):
    d = _hf_config(tmp_path, "tiny-gpt2", n_layer=10**9)
    assert main(["generate", str(d)]) == 2
    assert "beyond what memtrain builds" in _one_error_line(capsys.readouterr().err)


def test_model_bytes_beyond_host_memory_are_refused(monkeypatch):
    from memtrain.config.run import ConfigError, ModelConfig
    from memtrain.training import size_check

    monkeypatch.setattr(size_check, "host_memory_bytes", lambda: 2**20)  # 1 MiB of RAM
    with pytest.raises(ConfigError, match="more than this machine's"):
        size_check.check_model_size(ModelConfig(**TINY_MODEL))
    monkeypatch.setattr(size_check, "host_memory_bytes", lambda: 2**40)
    size_check.check_model_size(ModelConfig(**TINY_MODEL))


def test_model_weights_beyond_the_devices_memory_are_refused_at_their_precisions_width(monkeypatch):
    """On a GPU the weights are checked at 4 bytes each (FP32), 2 under bf16-pure: a device with
    3 bytes per parameter takes the bf16-pure model and refuses the FP32 one up front."""
    from memtrain.config.run import ConfigError, ModelConfig
    from memtrain.training import size_check

    m = ModelConfig(**TINY_MODEL)
    monkeypatch.setattr(size_check, "host_memory_bytes", lambda: 2**40)
    monkeypatch.setattr(size_check, "_device_memory_bytes", lambda device: 3 * size_check.model_parameters(m))
    with pytest.raises(ConfigError, match="more than cuda:0's"):
        size_check.check_model_size(m, "cuda:0", "fp32")
    size_check.check_model_size(m, "cuda:0", "bf16-pure")


def test_a_vocabulary_one_id_short_of_the_tokenizers_is_refused():
    """GPT-2's end-of-text id is 50256, the last row of a 50257-row table: 50256 rows would fail
    with an index error after the whole tokenization."""
    from memtrain.config.run import ConfigError, build_config
    from memtrain.training.preflight import check_vocab

    with pytest.raises(ConfigError, match="--vocab-size 50256 is smaller"):
        check_vocab(build_config({"vocab_size": 50256}))
    check_vocab(build_config({"vocab_size": 50257}))


# --------------------------------------------------------------------------- 4. resume on other data
def test_resume_refuses_other_content_at_the_same_data_path(small_corpus, tmp_path, capsys):
    data = tmp_path / "posts.jsonl"
    shutil.copy(small_corpus, data)
    run = {**RUN, "data": str(data), "steps": 4, "stop_after": 2, "save": str(tmp_path / "half.pt"),
           "out": str(tmp_path / "half")}
    assert main(["train", *cli_flags(run)]) == 0
    resumed = {**run, "stop_after": None, "save": None, "resume": str(tmp_path / "half.pt"), "out": str(tmp_path / "r")}
    lines = data.read_text().splitlines()
    data.write_text("\n".join(reversed(lines)) + "\n")  # same path, same size, other order
    capsys.readouterr()
    assert main(["train", *cli_flags({k: v for k, v in resumed.items() if v is not None})]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert str(data) in err and "does not hold the data" in err
    data.write_text("\n".join(lines) + "\n")  # the original content (a new mtime): resumes
    assert main(["train", *cli_flags({k: v for k, v in resumed.items() if v is not None})]) == 0


def test_resume_of_a_checkpoint_without_fingerprint_warns(small_corpus, tmp_path, capsys):
    import torch

    run = {**RUN, "data": str(small_corpus), "steps": 4, "stop_after": 2, "save": str(tmp_path / "half.pt"),
           "out": str(tmp_path / "half")}
    assert main(["train", *cli_flags(run)]) == 0
    state = torch.load(tmp_path / "half.pt", weights_only=True)
    assert isinstance(state["data_fingerprint"], str)
    del state["data_fingerprint"]  # as older versions wrote it
    torch.save(state, tmp_path / "old.pt")
    capsys.readouterr()
    resumed = {**run, "stop_after": None, "save": None, "resume": str(tmp_path / "old.pt"), "out": str(tmp_path / "r")}
    assert main(["train", *cli_flags({k: v for k, v in resumed.items() if v is not None})]) == 0
    assert "records no data fingerprint" in capsys.readouterr().err


def test_data_fingerprint_samples_large_files_and_ignores_mtime(tmp_path, monkeypatch):
    from memtrain.config.run import DataConfig
    from memtrain.data import sources

    monkeypatch.setattr(sources, "FINGERPRINT_WHOLE_BYTES", 1000)
    monkeypatch.setattr(sources, "FINGERPRINT_BLOCK_BYTES", 100)
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * 50_000)
    cfg = DataConfig(data=str(path))
    first = sources.data_fingerprint(cfg)
    os.utime(path, ns=(1, 1))
    assert sources.data_fingerprint(cfg) == first
    path.write_bytes(b"b" + b"a" * 49_999)  # the head block changed, size kept
    assert sources.data_fingerprint(cfg) != first


# --------------------------------------------------------------------------- 5. results readers
def _hostile_rows() -> list[str]:
    row = json.loads((DATA / "bench_results.jsonl").read_text().splitlines()[0])

    def variant(name: str, path: tuple, value) -> str:
        r = json.loads(json.dumps(row))
        r["technique"] = name
        target = r
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return json.dumps(r)

    return [
        _deep(100_000),
        '{"technique": "deep", "status": "ok", "x": ' + _deep(100_000) + "}",
        variant("big-int", ("val_ppl",), 0).replace('"val_ppl": 0', '"val_ppl": ' + "9" * 400),
        variant("big-peak", ("memory", "peak_bytes"), 0).replace('"peak_bytes": 0', '"peak_bytes": ' + "9" * 400),
        variant("null-config", ("config",), None),
        variant("list-memory", ("memory",), [1]),
        variant("text-rate", ("tokens_per_s",), "fast"),
        variant("text-width", ("config", "model", "d_model"), "wide"),
        variant("negative-time", ("step_time_s", "median"), -1),
        variant("huge-loss", ("val_loss",), 1e308),
        variant("list-hash", ("config_hash",), [1]),
        variant("text-env", ("env",), "cpu"),
        variant("object-scale", ("scale",), {"quick": 1}),  # the plots' titles hashed it: exit 1
    ]


def test_report_skips_hostile_rows_with_a_warning(tmp_path, capsys):
    good = (DATA / "bench_results.jsonl").read_text().splitlines()
    hostile = _hostile_rows()
    (tmp_path / "results.jsonl").write_text("\n".join([*good, *hostile]) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert f"skipped {len(hostile)} unreadable line(s)" in captured.err
    assert "Chunked LM-head loss" in captured.out


def test_plan_results_and_a_resumed_bench_read_hostile_rows(tmp_path):
    from memtrain.bench.runner import read_results
    from memtrain.commands.plan import _measured_effects

    good = (DATA / "bench_results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join([*good, *_hostile_rows()]) + "\n")
    rows = read_results(tmp_path)
    assert {r["technique"] for r in rows} <= {json.loads(line)["technique"] for line in good}
    assert {(r.get("technique"), r.get("config_hash")): r for r in rows}  # the bench's resume key: hashable
    assert _measured_effects(str(tmp_path), [{"precision": "bf16"}]) == ([None], [None], None, [None])


def test_a_results_file_past_the_size_limit_is_refused_before_a_byte_is_read(tmp_path, capsys):
    from memtrain.files import results

    limit = getattr(results, "MAX_JSONL_FILE_BYTES", 32 << 20)
    path = tmp_path / "results.jsonl"
    path.write_text((DATA / "bench_results.jsonl").read_text())
    os.truncate(path, limit + 1)  # sparse: no disk, no memory
    for argv in (["report", str(tmp_path)], ["plan", "--budget", "8GiB", "--results", str(tmp_path)]):
        start = time.monotonic()
        # Every byte was read: a sparse 8 GiB file held `memtrain report` 47 s, exit 0.
        assert main(argv) == 2
        assert time.monotonic() - start < 5
        line = _one_error_line(capsys.readouterr().err)
        assert f"{limit + 1:,} bytes" in line and "give another folder" in line
    assert not list(tmp_path.glob("report*")) and not list(tmp_path.glob("*.png"))  # nothing written


def test_report_of_1000_rows_takes_seconds(tmp_path):
    from memtrain.report import write_report
    from test_report_recommend import ROWS

    rows = []
    for i in range(1000):
        r = json.loads(json.dumps(ROWS[i % len(ROWS)]))
        r["technique"] = r["description"] = f"t{i}"
        rows.append(json.dumps(r))
    (tmp_path / "results.jsonl").write_text("\n".join(rows) + "\n")
    start = time.process_time()
    summary = write_report(tmp_path)
    assert summary["rows"] == 1000 and len(summary["plots"]) == 4
    # CPU time, not wall time (the machine may be shared): it was beyond 10 minutes.
    assert time.process_time() - start < 60
    assert "The plots show the first 40 of the 1000 rows" in (tmp_path / "report.md").read_text()


def test_a_row_with_a_long_name_is_plotted_with_a_bounded_label_and_tabled_whole(tmp_path, monkeypatch):
    """matplotlib's layout time grows with a label's length: a 200,000-character technique name
    took the report 159 s of CPU (a 5-million-character one had not finished after 200 s). Every
    text the plots draw from the name holds at most MAX_LABEL_CHARS of it (counted, not timed), its
    start and end kept; the table keeps the whole name."""
    import matplotlib.text

    from memtrain.report import write_report
    from memtrain.report.plots import MAX_LABEL_CHARS

    rows = (DATA / "bench_results.jsonl").read_text().splitlines()
    long_row = json.loads(rows[0])
    name = "A" * 10_000 + "Z" * 10_000
    long_row["technique"] = name
    (tmp_path / "results.jsonl").write_text("\n".join([json.dumps(long_row), *rows[1:]]) + "\n")
    drawn: list[str] = []
    set_text = matplotlib.text.Text.set_text

    def spy(self, s):
        if "AAAAAAAAAA" in str(s):
            drawn.append(str(s))
        return set_text(self, s)

    monkeypatch.setattr(matplotlib.text.Text, "set_text", spy)
    summary = write_report(tmp_path)
    assert len(summary["plots"]) == 4
    # The name's part of each text (a label may add its method or a unit after it).
    assert drawn and all(t.count("A") + t.count("Z") < MAX_LABEL_CHARS for t in drawn), max(map(len, drawn))
    assert all("A\u2026Z" in t for t in drawn)  # start and end kept around the ellipsis
    assert name in (tmp_path / "report.csv").read_text()  # the table keeps the name whole


def test_a_row_named_with_half_a_surrogate_pair_is_plotted_as_its_escape(tmp_path, capsys):
    from memtrain.report.plots import plain_label

    # "\ud800" is valid JSON; "\udcff" is how Python holds a file name's undecodable byte.
    assert plain_label("a\ud800b$\udcff") == "a\\ud800b\\$\\udcff"
    good = (DATA / "bench_results.jsonl").read_text().splitlines()
    (tmp_path / "results.jsonl").write_text("\n".join([good[0].replace('"baseline"', '"base\\ud800line"'), *good[1:]]) + "\n")
    # matplotlib refused the name (TypeError): exit 1 after report.md and report.csv were written.
    assert main(["report", str(tmp_path)]) == 0, capsys.readouterr().err
    assert len(list(tmp_path.glob("*.png"))) == 4
    assert "base\\ud800line" in (tmp_path / "report.csv").read_text(encoding="utf-8", errors="backslashreplace")


# --------------------------------------------------------------------------- 6. config files
@pytest.mark.parametrize("suffix, text", [
    (".json", '{"d_model": ' + _deep(100_000) + "}"),
    (".yaml", "d_model: " + _deep(100_000) + "\n"),
    (".toml", "d_model = " + _deep(100_000) + "\n"),
    (".yaml", "".join(" " * i + f"k{i}:\n" for i in range(1500)) + " " * 1500 + "x: 1\n"),  # block nesting
    (".json", '{"d_model": ' + "9" * 5000 + "}"),
    (".yaml", "d_model: " + "9" * 5000 + "\n"),
    (".toml", "d_model = " + "9" * 5000 + "\n"),
    (".yaml", "seed: " + "9" * 400 + "\n"),
])
def test_hostile_config_files_are_one_error_line(tmp_path, capsys, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    assert main(["estimate", "--config", str(path)]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "cannot parse config file" in err and ("nested deeper" in err or "digits" in err)
    assert "set_int_max_str_digits" not in err


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".toml"])
def test_a_config_file_the_size_of_data_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch, suffix):
    """A data file given as --config (corpus.json) was read whole and parsed: 85 MB took 7 s and
    630 MB before "holds a list"; GBs ran out of memory. Over 16 MiB is one line naming --data,
    from its size alone (the file is never opened)."""
    from pathlib import Path as PathType

    path = tmp_path / f"corpus{suffix}"
    with open(path, "wb") as f:
        f.truncate(20 * 2**20)  # sparse: 20 MiB on paper
    opened = []
    real_read_text = PathType.read_text
    monkeypatch.setattr(PathType, "read_text", lambda self, *a, **k: opened.append(self) or real_read_text(self, *a, **k))
    assert main(["estimate", "--config", str(path)]) == 2
    err = _one_error_line(capsys.readouterr().err)
    assert "is 20.0 MiB, more than the 16 MiB a config file may be" in err and "give it as --data" in err
    assert path not in opened


def test_yaml_aliases_sharing_a_list_are_checked_once(tmp_path):
    from memtrain.config.file import load_config_file

    laughs = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [" + ", ".join(["*" + chr(97 + i)] * 9) + "]\n" for i in range(9))
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs)
    start = time.process_time()
    assert set(load_config_file(path)) == {chr(97 + i) for i in range(10)}
    assert time.process_time() - start < 10  # 9**10 references if expanded


def test_a_lines_bytes_are_counted_once_for_the_reader_that_skips_and_the_one_that_refuses():
    """bounded_jsonl_lines (results.jsonl: a long line skipped) and the JSON data check (a long
    record refused) count a line's bytes over its pieces with one generator: the count so far
    and the 1-based line, reset after each newline."""
    from memtrain.files.json_text import counted_pieces

    got = list(counted_pieces([b"ab", b"c\n", b"de\n", b"\n", b"f"]))
    assert got == [(b"ab", 2, 1), (b"c\n", 4, 1), (b"de\n", 3, 2), (b"\n", 1, 3), (b"f", 1, 4)]
