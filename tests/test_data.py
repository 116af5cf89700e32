"""Tests of the data pipeline: tokenizer, sources, token cache, split and loaders (CPU, fast)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from memtrain.config.run import ConfigError, DataConfig
from memtrain.data import (
    EOT_ID,
    BlockDataset,
    cache as cache_mod,
    cache_key,
    default_corpus as corpus_mod,
    default_documents,
    get_tokenizer,
    html_to_text,
    iter_documents,
    make_train_loader,
    make_val_batches,
    prepare_tokens,
    source_identity,
    sources as sources_mod,
)

SAMPLE_XML = Path(__file__).resolve().parents[2] / "shared" / "data" / "stackoverflow_posts_sample.xml"

POSTS_XML = """<?xml version="1.0" encoding="utf-8"?>
<posts>
  <row Id="1" PostTypeId="1" Title="Opacity" Body="&lt;p&gt;How do I set &lt;b&gt;opacity&lt;/b&gt; &amp;amp; alpha?&lt;/p&gt;&#xA;&lt;pre&gt;&lt;code&gt;x = 1 &amp;lt; 2;&#xA;&lt;/code&gt;&lt;/pre&gt;" />
  <row Id="2" PostTypeId="2" Body="&lt;p&gt;Use &lt;code&gt;Opacity = 0.5&lt;/code&gt;.&lt;/p&gt;" />
  <row Id="3" PostTypeId="2" />
  <row Id="4" PostTypeId="2" Body="" />
  <row Id="5" PostTypeId="1" Body="&lt;ul&gt;&lt;li&gt;one&lt;/li&gt;&lt;li&gt;two&lt;/li&gt;&lt;/ul&gt;" />
</posts>
"""


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never touch the user's token cache."""
    monkeypatch.setenv("MEMTRAIN_CACHE", str(tmp_path / "cache"))


def cfg(data: str | Path, **kw) -> DataConfig:
    return DataConfig(data=str(data), **kw)


def docs_of(data: str | Path, **kw) -> list[str]:
    return list(iter_documents(cfg(data, **kw)))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def corpus(n: int = 200) -> list[str]:
    """Distinct documents of varying length."""
    return [f"Document number {i} says: " + "the quick brown fox jumps. " * (1 + i % 7) for i in range(n)]


# --------------------------------------------------------------------------- tokenizer
def test_tokenizer_is_gpt2() -> None:
    enc = get_tokenizer()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert EOT_ID == 50256 == enc.eot_token
    assert enc.n_vocab == 50257
    assert enc.encode("<|endoftext|>", allowed_special="all") == [EOT_ID]
    assert enc.encode_ordinary_batch(["Hello world", "Hello"], num_threads=2) == [[15496, 995], [15496]]
    assert get_tokenizer() is enc  # built once


# --------------------------------------------------------------------------- local sources
def test_txt_small_file_is_one_document(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("First paragraph.\n\nSecond paragraph.\n")
    assert docs_of(tmp_path / "a.txt") == ["First paragraph.\n\nSecond paragraph.\n"]


def test_txt_large_file_splits_at_blank_lines(tmp_path: Path) -> None:
    paragraphs = [f"Paragraph {i}. " + "words " * 200 + "\n" for i in range(100)]
    text = "\n".join(paragraphs)
    (tmp_path / "book.txt").write_text(text)
    docs = docs_of(tmp_path / "book.txt")
    assert len(docs) > 5
    assert "".join(docs) == text  # nothing lost or reordered
    assert all(d.endswith("\n\n") for d in docs[:-1])  # every cut falls on a blank line
    assert all(len(d) >= sources_mod.TXT_DOC_CHARS for d in docs[:-1])


def test_txt_without_blank_lines_is_still_cut(tmp_path: Path) -> None:
    """A file with no blank line is cut at 4 x TXT_DOC_CHARS, so its documents can be split
    between train and validation (one document would leave a split empty)."""
    text = "".join(f"Line {i}: " + "words " * 30 + "\n" for i in range(1000))
    (tmp_path / "log.txt").write_text(text)
    docs = docs_of(tmp_path / "log.txt")
    assert len(docs) > 1 and "".join(docs) == text
    assert all(len(d) <= 4 * sources_mod.TXT_DOC_CHARS + 200 for d in docs)


def test_token_ids_beyond_uint16_are_stored_as_uint32() -> None:
    """A vocabulary of 65536 ids fits uint16; one more id would wrap to 0 there."""
    assert cache_mod._token_dtype(65536) == np.uint16
    assert cache_mod._token_dtype(65537) == np.uint32


def test_glob_reads_files_in_sorted_order(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt", "c.txt"):
        (tmp_path / name).write_text(f"text of {name}")
    assert docs_of(tmp_path / "*.txt") == ["text of a.txt", "text of b.txt", "text of c.txt"]
    assert docs_of(tmp_path) == ["text of a.txt", "text of b.txt", "text of c.txt"]  # a folder: its files


def test_jsonl_and_json_and_csv(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"title": "t", "text": "alpha"}, {"title": "u", "text": "beta"}])
    assert docs_of(tmp_path / "d.jsonl") == ["alpha", "beta"]
    (tmp_path / "d.json").write_text(json.dumps([{"text": "gamma"}, {"text": "delta"}]))
    assert docs_of(tmp_path / "d.json") == ["gamma", "delta"]
    (tmp_path / "d.csv").write_text('text,n\nhello,1\n,2\n"two\nlines",3\n')
    assert docs_of(tmp_path / "d.csv") == ["hello", "two\nlines"]  # the empty value is skipped


def test_parquet_with_body_column(tmp_path: Path) -> None:
    table = pa.table({"Id": [1, 2, 3], "Body": ["<p>one</p>", "<p>two &amp; three</p>", None]})
    pq.write_table(table, tmp_path / "posts.parquet")
    assert docs_of(tmp_path / "posts.parquet", text_field="Body") == ["<p>one</p>", "<p>two &amp; three</p>"]
    assert docs_of(tmp_path / "posts.parquet", text_field="Body", strip_html=True) == ["one", "two & three"]


def test_posts_xml(tmp_path: Path) -> None:
    (tmp_path / "Posts.xml").write_text(POSTS_XML)
    raw = docs_of(tmp_path / "Posts.xml")
    assert len(raw) == 3  # row 3 has no Body, row 4 an empty one
    assert raw[1] == "<p>Use <code>Opacity = 0.5</code>.</p>"
    clean = docs_of(tmp_path / "Posts.xml", strip_html=True)
    assert clean[0] == "How do I set opacity & alpha?\n\nx = 1 < 2;"
    assert clean[1] == "Use Opacity = 0.5."
    assert clean[2] == "- one\n- two"
    assert docs_of(tmp_path / "Posts.xml", text_field="Title") == ["Opacity"]


def test_max_documents(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(50)])
    assert docs_of(tmp_path / "d.jsonl", max_documents=7) == corpus(50)[:7]


def test_strip_html() -> None:
    html = (
        "<h1>Title</h1><p>Caf&eacute; &lt;tag&gt; &#39;q&#39;<br/>next</p>"
        "<pre><code>if a &lt; b:\n    return a\n</code></pre><script>evil()</script><p>end</p>"
    )
    assert html_to_text(html) == "Title\n\nCafé <tag> 'q'\nnext\n\nif a < b:\n    return a\n\nend"
    assert html_to_text("plain text") == "plain text"


# --------------------------------------------------------------------------- Hugging Face path
def test_hf_builder_globs(tmp_path: Path) -> None:
    pq.write_table(pa.table({"text": ["p1", "p2"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["p3"]}), tmp_path / "b.parquet")
    assert docs_of(f"hf:parquet:{tmp_path}/*.parquet") == ["p1", "p2", "p3"]
    write_jsonl(tmp_path / "x.jsonl", [{"Body": "j1"}, {"Body": "j2"}])
    assert docs_of(f"hf:json:{tmp_path}/*.jsonl", text_field="Body") == ["j1", "j2"]
    (tmp_path / "x.csv").write_text("text\nc1\n")
    assert docs_of(f"hf:csv:{tmp_path}/x.csv") == ["c1"]


def test_hf_local_directory(tmp_path: Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [{"text": "one"}, {"text": "two"}, {"text": "three"}])
    assert docs_of(f"hf:{folder}") == ["one", "two", "three"]
    assert docs_of(f"hf:{folder}", max_documents=2) == ["one", "two"]
    assert source_identity(cfg(f"hf:{folder}"))["kind"] == "hf-dir"
    with pytest.raises(ConfigError, match="--hf-split"):
        docs_of(f"hf:{folder}", hf_split="validation")
    with pytest.raises(ConfigError, match="no directory"):
        docs_of(f"hf:{tmp_path / 'absent'}")


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch):
    """huggingface_hub's HTTP client, answering from ``answer(request)`` (a response, or an
    exception raised as the transport would): no connection is opened. Yields the dataset-card
    requests made (the library's own other requests, such as its once-a-day registry fetch, are
    answered 404 and not listed). The client factory is the library's public seam."""
    import huggingface_hub
    from huggingface_hub.utils import _http

    if not hasattr(huggingface_hub, "set_client_factory"):
        pytest.skip("huggingface_hub < 1 has no client factory")
    httpx = pytest.importorskip("huggingface_hub.utils").httpx
    requests: list = []
    answer = {"card": lambda request: httpx.Response(200, headers={"ETag": '"e"', "X-Repo-Commit": "c" * 40})}

    def handle(request):
        if not request.url.path.endswith("/README.md"):
            return httpx.Response(404)
        requests.append(request)
        return answer["card"](request)

    saved = _http._GLOBAL_CLIENT_FACTORY
    huggingface_hub.set_client_factory(lambda: httpx.Client(transport=httpx.MockTransport(handle)))
    yield requests, answer
    huggingface_hub.set_client_factory(saved)


def test_an_unreachable_hub_is_asked_once_then_one_line(monkeypatch: pytest.MonkeyPatch, fake_hub) -> None:
    """With no answer from the Hub (no network, a firewall), datasets' download tried the card six
    times with back-off (about 24 s) before the error. One HEAD request is made, with a timeout of
    a few seconds and no retry, and its failure is the one line, saying what to do; datasets is
    never called. Counted at the transport, not timed."""
    import datasets
    from huggingface_hub.utils import httpx

    from memtrain.data import prepare_splits, sources

    requests, answer = fake_hub

    def no_route(request):
        raise httpx.ConnectError("Name or service not known", request=request)

    answer["card"] = no_route
    called: list = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: called.append(a) or [])
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    for flag, data in (("--data", cfg("hf:owner/name")),
                       ("--val-data", DataConfig(data="default", val_data="hf:owner/name"))):
        with pytest.raises(ConfigError) as err:
            prepare_splits(data)
        line = str(err.value)
        assert line.startswith(f"cannot reach the Hugging Face Hub at {datasets.config.HF_ENDPOINT} for 'owner/name' "
                               "(Name or service not known); "), line
        for hint in (f"local file (e.g. {flag} posts.parquet", "HF_HUB_OFFLINE=1", "HF_ENDPOINT=URL"):
            assert hint in line, line
        assert "\n" not in line
    assert [(r.method, r.url.path) for r in requests] == [("HEAD", "/datasets/owner/name/resolve/main/README.md")] * 2
    timeout = requests[0].extensions["timeout"]
    assert timeout["connect"] == timeout["read"] == sources.HUB_PROBE_TIMEOUT_S
    assert called == []


def test_a_reachable_hub_and_an_offline_cache_hit_still_load(monkeypatch: pytest.MonkeyPatch, fake_hub) -> None:
    """Any answer from the Hub (the card, or a 404 for a set without one) lets datasets go on as
    before; with HF_HUB_OFFLINE=1 nothing is sent and datasets reads its cache (faked here: the
    records it would return). HF_HUB_ETAG_TIMEOUT, huggingface_hub's own knob, sets the wait."""
    import datasets
    from huggingface_hub.utils import httpx

    requests, answer = fake_hub
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split, streaming, **kw: [{"text": f"{name} doc"}])
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    assert docs_of("hf:owner/name") == ["owner/name doc"]
    answer["card"] = lambda request: httpx.Response(404, headers={"X-Error-Code": "EntryNotFound"})
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 30)  # as the library reads HF_HUB_ETAG_TIMEOUT=30
    assert docs_of("hf:owner/other") == ["owner/other doc"]
    assert [r.url.path.split("/")[3] for r in requests] == ["name", "other"]
    assert requests[1].extensions["timeout"]["connect"] == 30
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert docs_of("hf:owner/cached") == ["owner/cached doc"]
    assert len(requests) == 2  # offline: not one request


@pytest.mark.parametrize("status", [502, 503, 504])
def test_a_gateway_answering_for_an_unreachable_hub_is_one_line(monkeypatch: pytest.MonkeyPatch, fake_hub,
                                                                 status: int) -> None:
    """A proxy or gateway answering 502/503/504 (the Hub behind it did not answer) was taken for
    the Hub's answer: datasets then asked for the card again, with 1+2+4+8+8 s of back-off, and
    said it found no data file. It is the unreachable Hub's one line, naming the status and the
    endpoint; one request, datasets never called."""
    import datasets
    from huggingface_hub.utils import httpx

    requests, answer = fake_hub
    answer["card"] = lambda request: httpx.Response(status)
    called: list = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: called.append(a) or [])
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(ConfigError) as err:
        docs_of("hf:owner/name")
    line = str(err.value)
    assert line.startswith(f"cannot reach the Hugging Face Hub at {datasets.config.HF_ENDPOINT} for 'owner/name' "
                           f"(the endpoint answered {status} "), line
    for hint in ("HF_HUB_OFFLINE=1", "local file (e.g. --data posts.parquet", "HF_ENDPOINT=URL"):
        assert hint in line, line
    assert "\n" not in line and len(requests) == 1 and called == []


@pytest.mark.parametrize("status", [401, 403, 404])
def test_the_hubs_own_refusals_still_let_datasets_go_on(monkeypatch: pytest.MonkeyPatch, fake_hub, status: int) -> None:
    """401/403 (a gated set) and 404 (no card) come from the Hub itself: it is reachable, and
    datasets goes on to say the rest in its own words."""
    import datasets
    from huggingface_hub.utils import httpx

    requests, answer = fake_hub
    answer["card"] = lambda request: httpx.Response(status, headers={"X-Error-Code": "GatedRepo"})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split, streaming, **kw: [{"text": f"{name} doc"}])
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    assert docs_of("hf:owner/name") == ["owner/name doc"]
    assert len(requests) == 1


@pytest.mark.parametrize("env, offline", [
    ({"HF_HUB_OFFLINE": "1"}, True), ({"HF_HUB_OFFLINE": "true"}, True), ({"HF_HUB_OFFLINE": "YES"}, True),
    ({"TRANSFORMERS_OFFLINE": "on"}, True), ({"HF_DATASETS_OFFLINE": "1"}, True),
    ({"HF_DATASETS_OFFLINE": "0", "HF_HUB_OFFLINE": "1"}, False),  # datasets' own variable decides, as it reads them
    ({"HF_HUB_OFFLINE": "0"}, False), ({"HF_HUB_OFFLINE": "no"}, False), ({}, False),
])
def test_offline_mode_set_after_datasets_was_imported_is_seen(monkeypatch: pytest.MonkeyPatch, fake_hub,
                                                                env: dict, offline: bool) -> None:
    """datasets reads HF_HUB_OFFLINE once, at import (datasets.config.HF_HUB_OFFLINE): set later
    (a notebook, a wrapper script), it went unseen and the Hub was asked. The environment is read
    as the libraries read it, and datasets resolves the set offline (its switch on for the call,
    put back after); nothing is sent."""
    import datasets

    from memtrain.data import sources

    requests, _ = fake_hub
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # as read at import, before the variable was set
    seen: list = []

    def load(name, split, streaming, **kw):
        seen.append(datasets.config.HF_HUB_OFFLINE)
        return [{"text": f"{name} doc"}]

    monkeypatch.setattr(datasets, "load_dataset", load)
    assert sources.hub_offline(datasets) is offline
    assert docs_of("hf:owner/cached") == ["owner/cached doc"]
    assert len(requests) == (0 if offline else 1)
    assert seen == [offline] and datasets.config.HF_HUB_OFFLINE is False


def test_offline_set_late_and_not_cached_names_offline_mode(monkeypatch: pytest.MonkeyPatch, fake_hub) -> None:
    """With offline mode set after the import and the set not in the cache, datasets' error is
    the offline line (unset HF_HUB_OFFLINE ...), not the unreachable Hub's."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)

    def not_cached(*args, **kwargs):
        assert datasets.config.HF_HUB_OFFLINE is True
        raise ConnectionError("Couldn't reach the Hugging Face Hub for dataset 'owner/absent': offline mode is enabled")

    monkeypatch.setattr(datasets, "load_dataset", not_cached)
    with pytest.raises(ConfigError, match="not in the datasets cache and HF_HUB_OFFLINE is set"):
        docs_of("hf:owner/absent")
    assert fake_hub[0] == []


def test_hf_hub_unreachable_is_config_error(monkeypatch: pytest.MonkeyPatch, fake_hub) -> None:
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'mikex86/stackoverflow-posts' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ConfigError, match="cannot reach the Hugging Face Hub.*local file") as err:
        docs_of("hf:mikex86/stackoverflow-posts", max_documents=10)
    assert "\n" not in str(err.value)
    assert source_identity(cfg("hf:mikex86/stackoverflow-posts")) == {
        "kind": "hf", "name": "mikex86/stackoverflow-posts", "split": "train"
    }


def test_hub_stackoverflow_defaults_to_body(monkeypatch: pytest.MonkeyPatch, fake_hub) -> None:
    import datasets

    seen = {}

    def fake(name, split, streaming, **kwargs):
        seen.update(name=name, split=split, streaming=streaming)
        return [{"Id": i, "Body": f"<p>post {i}</p>"} for i in range(100)]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    docs = docs_of("hf:mikex86/stackoverflow-posts", max_documents=3, strip_html=True)
    assert docs == ["post 0", "post 1", "post 2"]
    assert seen == {"name": "mikex86/stackoverflow-posts", "split": "train", "streaming": True}


# --------------------------------------------------------------------------- real data
def test_stackoverflow_sample() -> None:
    if not SAMPLE_XML.is_file():
        pytest.skip(f"{SAMPLE_XML} not present")
    raw = docs_of(SAMPLE_XML)
    docs = docs_of(SAMPLE_XML, strip_html=True)
    assert len(raw) == len(docs) == 1000  # every one of the 1000 rows has a non-empty Body
    assert docs[0].startswith("I want to use a track-bar to change a form's opacity.\n\nThis is my code:")
    assert sum("<p>" in d for d in raw) > 900
    assert sum("<p>" in d for d in docs) == 2  # two posts quote HTML inside their code blocks


def test_default_source_is_large_and_deterministic() -> None:
    docs = default_documents()
    assert sum(len(d.encode()) for d in docs) >= 2_000_000
    assert len(docs) > 500
    assert any("json.dumps" in d for d in docs)  # docstrings of stdlib modules
    # Deterministic: topics in sorted order, then modules in sorted path order, each rendered
    # from its parse alone. Re-render a few modules (a full second parse costs seconds).
    paths = corpus_mod._stdlib_sources()
    assert paths == sorted(paths) == corpus_mod._stdlib_sources()
    module_docs = [d for d in map(corpus_mod._module_document, paths[:40]) if d]
    assert list(docs).index(module_docs[0]) + len(module_docs) <= len(docs)
    start = list(docs).index(module_docs[0])
    assert list(docs[start : start + len(module_docs)]) == module_docs
    assert list(iter_documents(cfg("default"))) == list(docs)
    assert source_identity(cfg("default"))["python"]


# --------------------------------------------------------------------------- cache and split
def test_prepare_tokens_and_cache_reuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = corpus(200)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    c = cfg(path, val_fraction=0.2)
    first = prepare_tokens(c, progress=False)
    assert not first.from_cache and first.tokens_per_s and first.tokens_per_s > 0
    assert first.n_train_docs + first.n_val_docs == 200 and first.n_val_docs > 0
    assert isinstance(first.train, np.memmap) and first.train.dtype == np.uint16
    # Each document ends with EOT, so EOT counts equal document counts.
    assert int((first.train == EOT_ID).sum()) == first.n_train_docs
    assert int((first.val == EOT_ID).sum()) == first.n_val_docs
    enc = get_tokenizer()
    assert len(first.train) + len(first.val) == sum(len(enc.encode_ordinary(t)) + 1 for t in texts)

    def forbidden(*args, **kwargs):
        raise AssertionError("a cache hit must not read the source or tokenize")

    monkeypatch.setattr(cache_mod, "get_tokenizer", forbidden)
    monkeypatch.setattr(cache_mod, "iter_documents", forbidden)
    second = prepare_tokens(c, progress=False)
    assert second.from_cache and second.tokens_per_s is None
    assert second.cache_path == first.cache_path
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    assert (second.n_train_docs, second.n_val_docs) == (first.n_train_docs, first.n_val_docs)


def test_no_cache_rebuilds_and_file_change_changes_key(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(50)])
    first = prepare_tokens(cfg(path), progress=False)
    again = prepare_tokens(cfg(path, no_cache=True), progress=False)
    assert not again.from_cache
    np.testing.assert_array_equal(again.train, first.train)
    key = cache_key(cfg(path))
    write_jsonl(path, [{"text": t} for t in corpus(51)])
    assert cache_key(cfg(path)) != key  # size and mtime are part of the key
    assert cache_key(cfg(path, strip_html=True)) != cache_key(cfg(path))


def test_interrupted_run_leaves_no_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(1200)])
    real = cache_mod.iter_documents

    def dies_midway(c):
        for i, doc in enumerate(real(c)):
            if i == 700:  # after one batch has been written
                raise KeyboardInterrupt
            yield doc

    monkeypatch.setattr(cache_mod, "iter_documents", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        prepare_tokens(cfg(path), progress=False)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(cache_mod, "iter_documents", real)
    assert not prepare_tokens(cfg(path), progress=False).from_cache


def test_the_id_width_holds_gpt2s_vocabulary() -> None:
    """The constant check cache.py once made with an assert (gone under ``python -O``)."""
    assert cache_mod.N_VOCAB <= np.iinfo(cache_mod.TOKEN_DTYPE).max + 1


def test_an_entry_that_cannot_be_read_back_is_an_error_not_an_assert(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache entry another process removes between its rename and the read, or tokens of a private
    folder that fail the reader's checks, are errors that say so (an assert vanished under
    ``python -O``, and the run went on with None)."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(20)])
    monkeypatch.setattr(cache_mod, "_load_entry", lambda *a, **k: None)
    with pytest.raises(OSError, match="could not be read back right after it was written"):
        prepare_tokens(cfg(path), progress=False)
    with pytest.raises(RuntimeError, match="do not read back as written"):
        cache_mod._tokenize_uncached(cfg(path), tmp_path / "cache", OSError(30, "Read-only file system"), False, None)


def test_a_target_mask_that_does_not_frame_its_ids_stops_the_run(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--loss-on completion: a mask one token short of its ids would shift every target; it is an
    error naming both lengths (an assert, dropped by ``python -O``, was all that stopped it)."""
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": f"Q{i}?", "completion": f" A{i}."} for i in range(10)])
    real = cache_mod._concat_masks
    monkeypatch.setattr(cache_mod, "_concat_masks", lambda *a: real(*a)[:-1])
    with pytest.raises(RuntimeError, match="target mask of .* frames .* ids"):
        prepare_tokens(cfg(path, data_format="prompt-completion", loss_on="completion"), progress=False)
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")]


def test_data_replaced_while_it_is_tokenized_is_refused_and_no_entry_is_kept(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A file replaced while its tokens are written mixed two versions under the first one's key,
    and the entry's meta.json recorded the second (read again at the end): the run is refused in
    one line and nothing is published; the same file left alone tokenizes as before."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(1200)])
    real = cache_mod.iter_documents

    def replaced_midway(c, *rest):
        for i, doc in enumerate(real(c, *rest)):
            if i == 700:  # after one batch has been written
                replacement = write_jsonl(tmp_path / "new.jsonl", [{"text": t} for t in corpus(30)])
                os.replace(replacement, path)
            yield doc

    monkeypatch.setattr(cache_mod, "iter_documents", replaced_midway)
    with pytest.raises(ConfigError, match="changed while it was being read"):
        prepare_tokens(cfg(path), progress=False)
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.setattr(cache_mod, "iter_documents", real)
    splits = prepare_tokens(cfg(path), progress=False)
    meta = json.loads((Path(splits.cache_path) / "meta.json").read_text())
    assert meta["source"] == json.loads(json.dumps(source_identity(cfg(path))))
    assert splits.n_train_docs + splits.n_val_docs == 30


def test_split_is_seeded_per_document(tmp_path: Path) -> None:
    texts = corpus(300)
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])

    def val_docs(seed: int) -> list[str]:
        # Through the cache: a second seed must not be answered by the first seed's entry.
        splits = prepare_tokens(cfg(path, val_fraction=0.2, split_seed=seed), progress=False)
        text = get_tokenizer().decode(splits.val.tolist())
        return [d for d in text.split("<|endoftext|>") if d]

    a, b, other = val_docs(1), val_docs(1), val_docs(2)
    assert a == b and a != other
    # The split is one rng.random() draw per document, in order (independent of batching).
    rng = np.random.default_rng(1)
    assert a == [t for t in texts if rng.random() < 0.2]


# --------------------------------------------------------------------------- loader
def test_block_dataset_packs_and_shifts() -> None:
    tokens = np.arange(23, dtype=np.uint16)
    ds = BlockDataset(tokens, seq_len=4)
    assert len(ds) == 4  # 23 // 5; the 3-token tail is dropped
    x, y = ds[1]
    assert x.dtype == torch.int64 and x.tolist() == [5, 6, 7, 8] and y.tolist() == [6, 7, 8, 9]
    with pytest.raises(IndexError):
        ds[4]


def test_block_dataset_pickles_a_memmap_by_file_name(tmp_path: Path) -> None:
    import pickle

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t.bin")
    ds = BlockDataset(np.memmap(tmp_path / "t.bin", dtype=np.uint16, mode="r"), seq_len=9)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the file name travels, not the tokens (spawned DataLoader workers)
    copy = pickle.loads(blob)
    assert isinstance(copy.tokens, np.memmap) and torch.equal(copy[3][0], ds[3][0])
    sliced = BlockDataset(ds.tokens[100:], seq_len=9)  # a slice of a map is pickled as data
    assert torch.equal(pickle.loads(pickle.dumps(sliced))[0][0], sliced[0][0])


def test_val_batches_are_fixed_leading_blocks() -> None:
    tokens = np.arange(100, dtype=np.uint16)
    batches = make_val_batches(tokens, seq_len=9, n_blocks=7, batch_size=3)
    assert [b[0].shape for b in batches] == [(3, 9), (3, 9), (1, 9)]
    xs = torch.cat([x for x, _ in batches])
    assert xs[:, 0].tolist() == [0, 10, 20, 30, 40, 50, 60]
    assert torch.equal(torch.cat([y for _, y in batches]), xs + 1)
    assert len(make_val_batches(tokens, seq_len=9, n_blocks=100, batch_size=4)) == 3  # only 10 blocks exist


def block_ids(x: torch.Tensor, seq_len: int) -> list[int]:
    return (x[:, 0] // (seq_len + 1)).tolist()


def test_train_loader_epochs_are_permutations() -> None:
    tokens = np.arange(10 * 9, dtype=np.uint16)  # 10 blocks of 8 + 1
    loader = make_train_loader(tokens, seq_len=8, batch_size=3, seed=0)
    assert loader.batches_per_epoch == 3
    epoch0 = [b for _ in range(3) for b in block_ids(loader.next_batch()[0], 8)]
    assert len(set(epoch0)) == 9 and loader.state_dict() == {"epoch": 1, "batch_index": 0}
    epoch1 = [b for _ in range(3) for b in block_ids(loader.next_batch()[0], 8)]
    assert epoch1 != epoch0  # a new permutation each epoch


@pytest.mark.parametrize("num_workers", [0, 2])
def test_train_loader_resumes_exactly(num_workers: int) -> None:
    tokens = np.arange(40 * 17, dtype=np.uint16)  # 40 blocks of 16 + 1
    kw = dict(seq_len=16, batch_size=4, seed=7, num_workers=num_workers)
    if num_workers:
        kw["prefetch_factor"] = 4  # workers run ahead; the state must not
    reference = make_train_loader(tokens, **kw)
    expected = [reference.next_batch() for _ in range(25)]  # crosses two epoch boundaries
    interrupted = make_train_loader(tokens, **kw)
    for _ in range(13):
        interrupted.next_batch()
    state = interrupted.state_dict()
    assert state == {"epoch": 1, "batch_index": 3}
    resumed = make_train_loader(tokens, **kw)
    resumed.load_state_dict(state)
    for want, (x, y) in zip(expected[13:], (resumed.next_batch() for _ in range(12))):
        assert torch.equal(x, want[0]) and torch.equal(y, want[1])


def test_without_workers_the_loader_gathers_the_dataloaders_batches() -> None:
    """The worker-less path (one vectorized gather, BlockDataset.batch) hands out exactly the
    batches DataLoader's per-sample loop and default collate make: values, dtype, shape, contiguity,
    across epoch boundaries, for every rank; an index out of range is refused."""
    from torch.utils.data import DataLoader

    tokens = np.random.default_rng(0).integers(0, 50257, size=61 * 33 + 7).astype(np.uint16)
    for rank in (0, 1):
        gathered = make_train_loader(tokens, seq_len=32, batch_size=5, seed=3, rank=rank, world_size=2)
        reference = make_train_loader(tokens, seq_len=32, batch_size=5, seed=3, rank=rank, world_size=2)
        collated = iter(DataLoader(reference.dataset, batch_sampler=reference._sampler()))
        for _ in range(3 * gathered.batches_per_epoch + 1):
            (x, y), (rx, ry) = gathered.next_batch(), next(collated)
            assert x.dtype == rx.dtype == torch.int64 and x.shape == rx.shape == (5, 32)
            assert x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x, rx) and torch.equal(y, ry)
    ds = BlockDataset(tokens, seq_len=32)
    with pytest.raises(IndexError, match="out of range"):
        ds.batch([0, len(ds)])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_pins_and_prefetches_as_asked(num_workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """--pin-memory pins every batch (the gathered path pins it itself; with workers the
    DataLoader is asked to) and --prefetch-factor reaches the DataLoader's workers. Pinning needs
    an accelerator, so here the calls are recorded, not made."""
    from memtrain.data import loader as loader_mod

    pinned: list = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.shape) or t)
    asked: dict = {}
    real = loader_mod.DataLoader

    def spy(*args, **kwargs):
        asked.update(kwargs)
        return real(*args, **{**kwargs, "pin_memory": False})

    monkeypatch.setattr(loader_mod, "DataLoader", spy)
    tokens = np.arange(40 * 17, dtype=np.uint16)
    loader = make_train_loader(tokens, seq_len=16, batch_size=4, seed=7, num_workers=num_workers,
                               pin_memory=True, prefetch_factor=3 if num_workers else None)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 16)
    if num_workers:
        assert asked["pin_memory"] is True and asked["prefetch_factor"] == 3 and asked["num_workers"] == 2
    else:
        assert pinned == [(4, 16), (4, 16)] and not asked  # x and y, and no DataLoader


def test_a_loader_position_past_the_epoch_is_refused() -> None:
    """A saved position is always inside an epoch (the batch after an epoch's last is the next
    epoch's first): batch_index == batches_per_epoch is another run's state, refused."""
    loader = make_train_loader(np.arange(10 * 9, dtype=np.uint16), seq_len=8, batch_size=3, seed=0)
    loader.load_state_dict({"epoch": 2, "batch_index": 2})
    for bad in ({"epoch": 0, "batch_index": 3}, {"epoch": -1, "batch_index": 0}, {"epoch": 0, "batch_index": -1}):
        with pytest.raises(ConfigError, match="does not fit this data"):
            loader.load_state_dict(bad)


def test_ranks_take_disjoint_blocks() -> None:
    tokens = np.arange(50 * 9, dtype=np.uint16)
    loaders = [make_train_loader(tokens, seq_len=8, batch_size=4, seed=3, rank=r, world_size=3) for r in range(3)]
    assert loaders[0].batches_per_epoch == 4  # 50 // 12
    seen = [set() for _ in loaders]
    for _ in range(4):
        for r, loader in enumerate(loaders):
            seen[r].update(block_ids(loader.next_batch()[0], 8))
    assert all(len(s) == 16 for s in seen)
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])


# --------------------------------------------------------------------------- bad input
def test_missing_file_and_glob(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no file matches .*check --data"):
        docs_of(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError, match=r"no file matches .*\*\.jsonl"):
        docs_of(tmp_path / "*.jsonl")
    with pytest.raises(ConfigError, match="no file matches"):
        prepare_tokens(cfg(tmp_path / "nope.txt"), progress=False)
    (tmp_path / "x.docx").write_text("?")
    with pytest.raises(ConfigError, match="unsupported file type '.docx'"):
        docs_of(tmp_path / "x.docx")


def test_empty_corpus(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": "   "}, {"text": None}])
    with pytest.raises(ConfigError, match="holds no documents"):
        docs_of(tmp_path / "e.jsonl")
    (tmp_path / "e.txt").write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no documents"):
        prepare_tokens(cfg(tmp_path / "e.txt"), progress=False)
    assert not any((tmp_path / "cache").iterdir())


def test_field_absent(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data.jsonl", [{"title": "a", "text": "b"}] * 3)
    with pytest.raises(ConfigError) as err:
        docs_of(tmp_path / "data.jsonl", text_field="Body")
    msg = str(err.value)
    assert "field 'Body' not found in record 1" in msg and "(fields: title, text); set --text-field" in msg
    (tmp_path / "Posts.xml").write_text(POSTS_XML)
    with pytest.raises(ConfigError, match="field 'Text' not found in any of the 5 rows.*set --text-field"):
        docs_of(tmp_path / "Posts.xml", text_field="Text")
    pq.write_table(pa.table({"n": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(ConfigError, match="holds int, not text"):
        docs_of(tmp_path / "n.parquet", text_field="n")


def test_unreadable_files(tmp_path: Path) -> None:
    broken = '<?xml version="1.0"?>\n<posts>\n  <row Body="ok" />\n  <row Body="x" <oops\n</posts>\n'
    (tmp_path / "Posts.xml").write_text(broken)
    with pytest.raises(ConfigError, match=r"cannot parse XML in .*Posts\.xml.* at line 4"):
        docs_of(tmp_path / "Posts.xml")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=r"cannot read .*bad\.jsonl"):
        docs_of(tmp_path / "bad.jsonl")


def test_a_bad_json_line_is_named_by_its_line_number(tmp_path: Path) -> None:
    """pyarrow's "in row N" counts from 0 within its current block: the first line was "row 0",
    and a line past the first 10 MB block was counted from that block's start. The line is found
    and named from 1."""
    first = tmp_path / "first.jsonl"
    first.write_text('{bad\n{"text": "fine"}\n')
    with pytest.raises(ConfigError, match=r"cannot read .*first\.jsonl.*: line 1 is not valid JSON .*column 2"):
        docs_of(first)
    big = write_jsonl(tmp_path / "big.jsonl", [{"text": "hello world " * 80}] * 12000)  # past one 10 MB block
    with big.open("a") as fh:
        fh.write('{"text": "fine"}\n7\n')
    with pytest.raises(ConfigError, match=r"line 12002 holds a JSON number, not a record") as err:
        docs_of(big)
    assert "row" not in str(err.value)


@pytest.mark.parametrize("text, words", [("[1, 2, 3]", "holds an array of JSON numbers, not records"),
                                         ("[[1], [2]]", "holds an array of JSON arrays, not records")])
def test_json_records_that_are_not_objects_are_named_so(text, words, tmp_path: Path) -> None:
    """An array of numbers was read as a column datasets names 'text': the refusal spoke of a
    field 'text' holding int "(fields: text)", which the file never had."""
    path = tmp_path / "nums.json"
    path.write_text(text)
    for field in ("text", "body"):
        with pytest.raises(ConfigError, match=words) as err:
            docs_of(path, text_field=field)
        assert "fields:" not in str(err.value)
    lines = tmp_path / "nums.jsonl"
    lines.write_text("1\n2\n")
    with pytest.raises(ConfigError, match="line 1 holds a JSON number, not a record"):
        docs_of(lines)


@pytest.mark.parametrize("name", ["cut.json", "cut.jsonl"])
def test_a_first_record_cut_inside_a_utf8_character_by_the_64_kib_peek_is_read(name, tmp_path: Path) -> None:
    """Preflight peeks at a JSON data file's head twice: 64K characters (decoded, bad bytes
    replaced) for the first record's kind and 64 KiB of bytes for whether it is an array read
    whole. A first record whose text crosses byte 65536 inside a two-byte character is read, in
    either layout, not refused for a broken character neither reader owns."""
    start = len('[{"text": "' if name.endswith(".json") else '{"text": "')  # ASCII: a byte a character
    text = "a" * ((start + 1) % 2) + "é" * 40000  # 80,000 bytes of é, from an odd byte of the file
    record = json.dumps({"text": text}, ensure_ascii=False)
    body = f"[{record}]" if name.endswith(".json") else record + "\n"
    first_e = body.encode().index("é".encode())
    assert (65536 - first_e) % 2 == 1  # byte 65536 ends inside an é, not between two
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    assert docs_of(path) == [text]


@pytest.mark.parametrize("name, text, words", [
    ("a.jsonl", "not json\n", "line 1 is not valid JSON (Expecting value at column 1)"),
    ("b.jsonl", "nope\n", "line 1 is not valid JSON"),
    ("c.jsonl", "\ntrue story\n", "line 2 is not valid JSON (Extra data at column 6)"),
    ("d.jsonl", "fals\n", "line 1 is not valid JSON"),
    ("e.json", "[nope]", "line 1 is not valid JSON (Expecting value at column 2)"),
])
def test_a_first_record_that_is_not_json_is_said_to_be_not_json(name, text, words, tmp_path: Path) -> None:
    """Its first character was taken for the record's kind: "not json" was "a JSON null", "true
    story" "a JSON boolean"."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        docs_of(path)
    assert f"cannot read {str(path)!r}: {words}" in str(err.value)
    assert "holds a JSON" not in str(err.value)


def test_too_small_corpus() -> None:
    with pytest.raises(ConfigError) as err:
        make_train_loader(np.zeros(1234, np.uint16), seq_len=256, batch_size=8, seed=0)
    assert str(err.value) == (
        "training corpus has 1,234 tokens, fewer than one batch needs (8 x 257 = 2,056); "
        "use more data or lower --batch-size / --seq-len"
    )
    with pytest.raises(ConfigError, match=r"8 x 2 ranks x 257 = 4,112"):
        make_train_loader(np.zeros(3000, np.uint16), seq_len=256, batch_size=8, seed=0, world_size=2)
    with pytest.raises(ConfigError, match="--val-fraction"):
        make_val_batches(np.zeros(100, np.uint16), seq_len=256, n_blocks=32, batch_size=8)


def _lines_txt(path: Path, docs: int, lines: int) -> Path:
    """A .txt of ``docs`` documents of ``lines`` short lines each, a blank line between them."""
    words = "memory training model token batch layer the of and a to in".split()
    rng = np.random.default_rng(0)
    text = "\n".join("".join(" ".join(rng.choice(words, 15)) + "\n" for _ in range(lines)) for _ in range(docs))
    path.write_text(text)
    return path


@pytest.mark.parametrize("docs, lines, val_fraction, words", [
    # ~29 KB without a blank line: one document, which no --val-fraction can split
    (1, 400, "0.05", ["the validation split is empty: --data", "is one document (a .txt is cut into documents at the "
                      "first blank line after each 8,192 characters", "lands wholly in one split",
                      "put a blank line between its documents, give more text, or give a .jsonl"]),
    (3, 120, "0.05", ["the validation split is empty: none of the 3 documents of --data", "at --val-fraction 0.05",
                      "raise --val-fraction (to 0.5 or more), change --split-seed or use more data"]),
    (3, 120, "0.99", ["the training split is empty: all 3 documents of --data", "lower --val-fraction"]),
])
def test_a_split_left_without_a_document_says_what_the_data_holds(tmp_path, capsys, docs, lines, val_fraction, words):
    """A .txt of few documents left a split empty, and the line only said "raise --val-fraction"
    (useless for one document, whichever split it lands in); it now says how many documents the
    data is and what changes that. Nothing is left in --out."""
    from memtrain.cli import main

    data = _lines_txt(tmp_path / "few.txt", docs, lines)
    out = tmp_path / "out"
    code = main(["train", "--data", str(data), "--val-fraction", val_fraction, "--steps", "1", "--batch-size", "1",
                 "--seq-len", "32", "--out", str(out), "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert all(w in errors[0] for w in words), errors[0]
    assert not out.exists()


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EIO"])
def test_a_cache_disk_that_fills_while_writing_the_entry_tokenizes_without_it(tmp_path, capsys, monkeypatch, code):
    """The token cache's disk filling up (or failing) while an entry was written ended the run
    (`disk full writing ...`, exit 1) although the cache only saves time: the run now goes on as
    with an unwritable cache, one warning line, the same tokens, no half entry left."""
    import errno

    monkeypatch.delenv("MEMTRAIN_CACHE", raising=False)  # the folders below, not the tests' shared cache
    data = _lines_txt(tmp_path / "d.txt", 6, 120)
    cfg = DataConfig(data=str(data), cache_dir=str(tmp_path / "cache"), val_fraction=0.5)
    expected = prepare_tokens(DataConfig(data=str(data), cache_dir=str(tmp_path / "other"), val_fraction=0.5))
    real = cache_mod._write_tokens

    def full_in_the_cache(cfg_, out, *args, **kwargs):
        if (tmp_path / "cache") in Path(out).parents:
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(out / "train.bin"))
        return real(cfg_, out, *args, **kwargs)

    monkeypatch.setattr(cache_mod, "_write_tokens", full_in_the_cache)
    splits = prepare_tokens(cfg)
    assert "warning: token cache" in capsys.readouterr().err
    assert splits.cache_path == "" and np.array_equal(splits.train, expected.train)
    assert np.array_equal(splits.val, expected.val)
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".tmp-")] == []


def test_a_cache_entry_of_another_tokenizer_or_source_is_rebuilt(tmp_path: Path) -> None:
    """An entry whose meta.json records another tokenizer or source (an entry copied or moved in
    under this key from another) was used as this run's: its ids trained the model and
    result.json's data.tokenizer named the other tokenizer. It is rebuilt, the ids this run's."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(50)])
    first = prepare_tokens(cfg(path), progress=False)
    meta_path = Path(first.cache_path) / "meta.json"
    written = json.loads(meta_path.read_text())
    for key, foreign in (("tokenizer", {"name": "hf-0123456789abcdef", "n_vocab": 50257, "eot_id": 0}),
                         ("source", {"kind": "files", "files": [{"path": "/elsewhere/other.jsonl"}]})):
        meta_path.write_text(json.dumps({**written, key: foreign}))
        again = prepare_tokens(cfg(path), progress=False)
        assert not again.from_cache and again.tokenizer == "gpt2", key
        np.testing.assert_array_equal(again.train, first.train)
        assert json.loads(meta_path.read_text())[key] == written[key]
    assert prepare_tokens(cfg(path), progress=False).from_cache  # the rebuilt entry is read again


def test_a_cache_entry_that_is_a_dangling_link_is_replaced(tmp_path: Path) -> None:
    """A dangling link at an entry's name (its folder removed, a link into a cache elsewhere)
    ended the run: `NotADirectoryError` renaming the new entry onto it, exit 1. The link is
    replaced by the entry; a link to a folder is replaced by name, its folder left as it was."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(50)])
    entry = tmp_path / "cache" / cache_key(cfg(path))
    entry.parent.mkdir()
    entry.symlink_to(tmp_path / "gone")
    first = prepare_tokens(cfg(path), progress=False)
    assert entry.is_dir() and not entry.is_symlink() and not first.from_cache
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    os.rename(entry, tmp_path / "moved")
    entry.symlink_to(elsewhere)
    again = prepare_tokens(cfg(path), progress=False)
    np.testing.assert_array_equal(again.train, first.train)
    assert entry.is_dir() and not entry.is_symlink() and (elsewhere / "keep.txt").read_text() == "mine"
    assert [p.name for p in entry.parent.iterdir() if p.name.startswith(".old-")] == []

def test_hf_dir_of_txt_is_one_document_per_line_as_its_help_and_the_readme_say(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """datasets' text builder makes each line a document; memtrain's .txt reader keeps a short file whole.
    The two give different documents (so different splits), which --data's help and the README state."""
    from memtrain.cli import main

    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("line one\nline two\n\nline three\n")
    assert docs_of(f"hf:{folder}") == ["line one", "line two", "line three"]
    assert docs_of(folder) == ["line one\nline two\n\nline three\n"]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    train_help = " ".join(capsys.readouterr().out.split())
    assert "a .txt in hf:DIR is one document per line" in train_help
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "a `.txt` read through `hf:` is one document per line" in readme


def test_strip_html_lists_inline_breaks_pre_and_a_stray_close() -> None:
    """Each list item on its own "- " line; a source line break between inline elements is a word
    space (none after a block); one inside <pre> is kept; a stray </script> hides nothing after it."""
    assert html_to_text("<ul><li>one</li><li>two</li></ul>after") == "- one\n- two\nafter"
    assert html_to_text("<p>a</p>\n<p>b <b>x</b>\n<i>y</i></p>") == "a\n\nb x y"
    assert html_to_text("<pre><code>x = 1</code>\n<code>y = 2</code></pre>") == "x = 1\ny = 2"
    assert html_to_text("</script>text<script>hidden()</script> shown") == "text shown"


def test_every_setting_that_changes_the_tokens_changes_the_cache_key(tmp_path: Path) -> None:
    """Two runs whose tokens differ must never share an entry: each field of the key, changed
    alone, gives another key (the tokenizer's name, size, end-of-text id and bos prefix too)."""
    from types import SimpleNamespace

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in corpus(5)])
    base = cache_key(cfg(path))
    changed = {"text_field": "body", "max_documents": 3, "val_fraction": 0.2, "split_seed": 7}
    for field, value in changed.items():
        assert cache_key(cfg(path, **{field: value})) != base, field
    tok = SimpleNamespace(name="org/model", n_vocab=32000, eot_id=2, prefix_ids=[])
    keys = {cache_key(cfg(path), SimpleNamespace(**{**vars(tok), **change}))
            for change in ({}, {"name": "org/other"}, {"n_vocab": 32001}, {"eot_id": 0}, {"prefix_ids": [1]})}
    assert len(keys) == 5 and base not in keys
