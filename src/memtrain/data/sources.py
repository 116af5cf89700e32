"""Text sources: everything that turns ``--data`` into a stream of documents (``str``).

``--data`` selects one of four kinds of source:

* ``default``: English technical prose from the running Python's own documentation
  (``pydoc`` topics and the standard library's docstrings, :mod:`memtrain.data.default_corpus`);
  needs no download.
* ``hf:NAME``: a Hugging Face dataset, streamed. ``hf:`` followed by a local directory,
  or ``hf:json:GLOB`` / ``hf:parquet:GLOB`` / ``hf:csv:GLOB``, reads local data through the
  same code, which is how this path works (and is tested) without the Hub.
* local files or a glob: ``.txt``, ``.jsonl``/``.json``, ``.parquet``, ``.csv``; ``.jsonl``,
  ``.json`` and ``.csv`` go through ``datasets`` so they share the Hugging Face path, ``.parquet``
  through pyarrow a few rows at a time (datasets decodes a whole row group at once).
* any ``.xml`` file: a Stack Exchange dump such as ``Posts.xml``, read incrementally.

:func:`iter_documents` is the one entry point; :func:`source_identity` describes the
source for the token cache key. Every bad input raises :class:`ConfigError` with a one-line
message naming the problem and the fix.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import glob
import hashlib
import http
import inspect
import itertools
import json
import os
import platform
import re
import sys
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Callable, Optional

from memtrain.config.run import ConfigError, DataConfig, val_data_message
from memtrain.data import json_records
from memtrain.data.default_corpus import DEFAULT_CORPUS_VERSION, default_documents
from memtrain.data.html_text import html_to_text
from memtrain.data.json_records import check_json_nesting, check_json_records, first_bad_json_line
from memtrain.data.records import Render
from memtrain.data.tokenizer import cut_before_word
from memtrain.errors import first_line
from memtrain.files.guard import folder_entry_problems, special_file_kind, visible_entries
from memtrain.files.json_file import JsonFileProblem, read_json_file
from memtrain.runtime.extras import import_extra, quiet_datasets
from memtrain.runtime.notices import PartOfARecordWarning

DEFAULT_SOURCE = "default"
STACKOVERFLOW_HF = "mikex86/stackoverflow-posts"

# File suffix -> ``datasets`` packaged builder.
STRUCTURED_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
HF_BUILDERS = ("json", "parquet", "csv")
JSON_SUFFIXES = (".jsonl", ".json")  # read by the json builder: nesting is bounded first
TEXT_SUFFIXES = (".txt",)
XML_SUFFIXES = (".xml",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + tuple(STRUCTURED_BUILDERS) + XML_SUFFIXES

# A .txt file is cut into documents at the first blank line after this many characters
# (and at any line break after four times as many, for text without blank lines). A file
# smaller than that stays one document; a single large file, such as a book, becomes many
# documents, which the document-level train/validation split needs: one document could
# only land wholly in one split. Each piece gets its own end-of-text token; at this size
# (about 2,000 tokens) those artificial boundaries are rare inside training blocks.
TXT_DOC_CHARS = 8192
# A line longer than this is read in pieces and cut, at a word break where there is one
# (memtrain.data.tokenizer.encoding_pieces), into documents of at most this many characters:
# reading a 200 MB line whole, then tokenizing it, needed gigabytes.
TXT_MAX_LINE_CHARS = 1 << 20


# --------------------------------------------------------------------------- entry points
def iter_documents(cfg: DataConfig, render: Optional[Render] = None) -> Iterator[str]:
    """Yield the documents of ``cfg.data`` in a fixed order.

    HTML is stripped when ``cfg.strip_html`` is set, empty documents are skipped and at most
    ``cfg.max_documents`` are yielded. A source with no documents raises ConfigError.
    ``render`` (:func:`memtrain.data.records.make_renderer`, --data-format other than text) makes
    each structured record's document; a record it returns None for is read by its text field.
    """
    docs: Iterable[str] = _raw_documents(cfg, render)
    if cfg.strip_html:
        docs = map(html_to_text, docs)
    docs = (d for d in docs if d and not d.isspace())
    if cfg.max_documents is not None:
        docs = itertools.islice(docs, cfg.max_documents)
    count = 0
    for doc in docs:
        count += 1
        yield doc
    if count == 0:
        raise ConfigError(
            f"{cfg.data!r} holds no documents (every text is empty or missing); "
            f"check --data and --text-field"
        )


def source_identity(cfg: DataConfig) -> dict[str, Any]:
    """What identifies the source's content, cheaply (no reading): the cache key uses it.

    Local files contribute resolved path, size and modification time, so editing a file
    invalidates its cached tokens; the default corpus depends only on the Python version;
    a Hub dataset is named by its name and split (it cannot be checked without the network).
    """
    if cfg.data == DEFAULT_SOURCE:
        return {
            "kind": "default",
            "python": platform.python_version(),
            "implementation": sys.implementation.name,
            "corpus_version": DEFAULT_CORPUS_VERSION,
        }
    if cfg.data.startswith("hf:"):
        kind, target = _parse_hf(cfg.data)
        if kind == "hub":
            return {"kind": "hf", "name": target, "split": cfg.hf_split}
        if kind == "dir":
            files = sorted(p for p in Path(target).rglob("*") if p.is_file() and not _hidden(p, Path(target)))
            return {
                "kind": "hf-dir",
                "path": str(Path(target).resolve()),
                "split": cfg.hf_split,
                "files": [_file_stat(p) for p in files],
            }
        return {"kind": f"hf-{kind}", "files": [_file_stat(p) for p in _match_files(target, cfg.data)]}
    return {"kind": "files", "files": [_file_stat(p) for p in resolve_local_files(cfg.data)]}


# The content fingerprint of local data (data_fingerprint): files up to this size are hashed
# whole; a larger one by its head, its tail and evenly spaced blocks between (a few MiB read
# per file, whatever its size).
FINGERPRINT_WHOLE_BYTES = 16 << 20
FINGERPRINT_BLOCK_BYTES = 64 << 10
FINGERPRINT_BLOCKS = 32
# A --chat-template is at most 1 MiB (memtrain.models.tokenizer.MAX_CHAT_TEMPLATE_BYTES); a byte past it
# changes nothing here, as the file is refused when read.
MAX_TEMPLATE_HASH_BYTES = (1 << 20) + 1


def data_fingerprint(cfg: DataConfig) -> str:
    """A SHA-256 of what the source holds, for ``--resume`` to refuse other data at the same path.

    Local files contribute their sizes and contents (sampled beyond FINGERPRINT_WHOLE_BYTES:
    an edit that keeps a large file's size and misses every sampled block goes unseen), not
    their paths or modification times, so a copied or touched file still resumes. The default
    corpus and Hub datasets contribute their identity (Python version; name and split). A
    ``--chat-template`` file contributes its content: it renders every record. A validation source
    of its own (--val-data, --val-split) contributes its fingerprint: a resume refuses other
    validation text at the same path as it refuses other training text (a fingerprint without one
    is as it always was).
    """
    identity = source_identity(cfg)
    h = hashlib.sha256(identity["kind"].encode())
    files = identity.get("files")
    if files is None:
        h.update(json.dumps(identity, sort_keys=True).encode())
    for f in files or ():
        h.update(f"\n{f['size']}\n".encode())
        try:
            _hash_content(Path(f["path"]), int(f["size"]), h)
        except OSError as exc:
            raise ConfigError(f"cannot read {f['path']!r} ({exc.strerror or type(exc).__name__}); check --data") from None
    _hash_chat_template(cfg, h)
    val_cfg = cfg.validation_config()
    if val_cfg is not None:
        try:
            h.update(b"\nval_data\n" + data_fingerprint(val_cfg).encode())
        except ConfigError as exc:
            raise ConfigError(val_data_message(str(exc))) from None
    return h.hexdigest()


def _hash_chat_template(cfg: DataConfig, h: Any) -> None:
    """Feed ``--chat-template``'s content to ``h`` (nothing without one, so other fingerprints stay as
    they were): the file renders every record, so an edit in place is other data at the same paths
    (a bench's rows run again, a resume is refused). A file that cannot be read adds nothing here:
    reading it as the template says what is wrong."""
    if cfg.chat_template is None:
        return
    path = Path(cfg.chat_template).expanduser()
    if special_file_kind(path) is not None or not path.is_file():
        return
    h.update(b"\nchat_template\n")
    with path.open("rb") as fh:
        h.update(fh.read(MAX_TEMPLATE_HASH_BYTES))  # a template past memtrain's limit is refused when read


def _hash_content(path: Path, size: int, h: Any) -> None:
    """Feed ``path``'s content to ``h``: all of it when small, else sampled blocks."""
    with path.open("rb") as fh:
        if size <= FINGERPRINT_WHOLE_BYTES:
            while block := fh.read(1 << 20):
                h.update(block)
            return
        last = size - FINGERPRINT_BLOCK_BYTES
        for i in range(FINGERPRINT_BLOCKS):
            fh.seek(last * i // (FINGERPRINT_BLOCKS - 1))  # first block at 0, last one ends at the end
            h.update(fh.read(FINGERPRINT_BLOCK_BYTES))


def default_text_field(cfg: DataConfig, kind: str) -> str:
    """The field holding the text: ``--text-field``, else 'Body' for Stack Overflow data, else 'text'."""
    if cfg.text_field:
        return cfg.text_field
    return "Body" if kind in ("xml", STACKOVERFLOW_HF) else "text"


def _raw_documents(cfg: DataConfig, render: Optional[Render] = None) -> Iterator[str]:
    """Dispatch on ``cfg.data``; documents may still be empty or hold HTML."""
    if cfg.data == DEFAULT_SOURCE:
        return iter(default_documents())
    if cfg.data.startswith("hf:"):
        return _hf_documents(cfg, render)
    return _local_documents(resolve_local_files(cfg.data), cfg, render)


# --------------------------------------------------------------------------- local files
def resolve_local_files(pattern: str) -> list[Path]:
    """Files named by ``--data``: one file, a glob (sorted) or a directory (supported files, sorted)."""
    path = Path(pattern).expanduser()
    if glob.has_magic(pattern):
        files = _match_files(pattern, pattern)
    elif path.is_dir() and is_saved_dataset(path):
        raise ConfigError(f"--data {pattern!r} is a folder written by datasets' save_to_disk; give --data hf:{pattern}")
    elif path.is_dir():
        files = sorted(p for p in listed_entries(pattern) if p.is_file())
        if not files:
            raise ConfigError(
                f"directory {pattern!r} holds no {', '.join(SUPPORTED_SUFFIXES)} files; check --data"
            )
    elif path.is_file():
        files = [path]
    elif (kind := special_file_kind(path)) is not None:
        raise ConfigError(f"--data {pattern!r} is {kind}, not a file; give a file, a glob, a folder, 'default' or hf:NAME")
    else:
        raise _no_file_matches(pattern, "check --data (a file, a glob, 'default' or hf:NAME)")
    for p in files:
        if p.suffix.lower() not in SUPPORTED_SUFFIXES:
            raise ConfigError(
                f"unsupported file type {p.suffix or '(none)'!r} for {str(p)!r}; "
                f"use {', '.join(SUPPORTED_SUFFIXES)} or convert the file"
            )
        try:  # said now, before anything is written, not midway through tokenizing
            with p.open("rb"):
                pass
        except OSError as exc:
            raise ConfigError(f"cannot read --data file {str(p)!r} ({exc.strerror or type(exc).__name__}); "
                              "check its permissions") from None
    return files


def local_data_lines(data: str) -> list[str]:
    """What ``train`` says of local ``--data`` before it reads it: the files' summary, and a
    warning when a folder holds one name in several formats; nothing for the default corpus or
    ``hf:`` (a bad ``--data`` is left for the run's own check to report)."""
    if data == DEFAULT_SOURCE or data.startswith("hf:"):
        return []
    try:
        files = resolve_local_files(data)
        lines = [files_summary(files)]
    except (ConfigError, OSError):
        return []
    warning = same_data_warning(files)
    return lines + ([warning] if warning else [])


def files_summary(files: list[Path]) -> str:
    """One line naming how many files ``--data`` reads, of which kinds, and their size, e.g.
    ``data: 3 files (1 .jsonl, 1 .json, 1 .parquet), 2.1 MB``: a folder or a glob reads every
    supported file in it, which nothing else told the user."""
    kinds: dict[str, int] = {}
    for p in files:
        kinds[p.suffix.lower()] = kinds.get(p.suffix.lower(), 0) + 1
    size = sum(p.stat().st_size for p in files)
    counts = ", ".join(f"{n} {suffix}" for suffix, n in kinds.items())
    return f"data: {len(files)} file{'' if len(files) == 1 else 's'} ({counts}), {decimal_size(size)}"


def decimal_size(size: int) -> str:
    """``size`` bytes in the largest decimal unit it reaches, to one decimal (``512 B``, ``1.4 kB``,
    ``2.1 MB``, ``3.2 GB``), as ``ls -h --si`` and file managers show a file's size.
    MB alone printed a small chat file as ``0.0 MB``, which reads as empty."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def same_data_warning(files: list[Path]) -> Optional[str]:
    """A warning line when files of one folder share a name in different formats
    (posts.jsonl beside posts.parquet): likely one data set written twice, which training
    would then read twice and could place in both the train and the validation split."""
    formats: dict[Path, list[str]] = {}
    for p in files:
        formats.setdefault(p.with_suffix(""), []).append(p.suffix)
    twins = [f"{str(stem)!r} as {', '.join(sorted(suffixes))}" for stem, suffixes in formats.items()
             if len({s.lower() for s in suffixes}) > 1]
    if not twins:
        return None
    return (f"warning: --data holds {'; '.join(twins)}: likely the same data twice, which training reads "
            "every time, into train and validation alike; keep one format or narrow --data to a glob ('*.jsonl')")


def listed_entries(pattern: str) -> Iterator[Path]:
    """Every entry the reader lists for the local ``--data`` ``pattern`` (a glob, ``**`` any depth;
    a folder: its supported files at any depth, hidden ones too, links to folders not followed, as
    ``rglob`` walks; a file: itself), before it keeps the files among them. A link that dangles now is listed:
    once a run writes its target, the next run reads it (``preflight.check_out_outside_data``)."""
    path = Path(pattern).expanduser()
    if glob.has_magic(pattern):
        return _glob_entries(pattern)
    if path.is_dir():
        return (p for p in path.rglob("*") if p.suffix.lower() in SUPPORTED_SUFFIXES)
    return iter([path] if path.is_symlink() or path.is_file() else [])


def _glob_entries(pattern: str) -> Iterator[Path]:
    return (Path(p) for p in glob.iglob(str(Path(pattern).expanduser()), recursive=True))


def _match_files(pattern: str, data: str) -> list[Path]:
    """Sorted files matching a glob (``**`` allowed); none -> ConfigError naming ``--data``."""
    files = sorted(p for p in _glob_entries(pattern) if p.is_file())
    if not files:
        raise _no_file_matches(pattern, f"check --data {data!r}")
    return files


# A URL's scheme ("https://", "s3://", "file://"): memtrain reads no URL; one given as --data was
# looked for as a local path and said to match no file, as if the name were mistyped.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _no_file_matches(pattern: str, check: str) -> ConfigError:
    """The refusal of a ``--data`` path or glob that names no file; of a URL, saying so."""
    if _URL.match(pattern):
        return ConfigError(f"--data {pattern!r} is a URL; memtrain reads local files and Hugging Face datasets, not "
                           "URLs: download it and give its path (or hf:ORG/NAME for a Hub dataset)")
    return ConfigError(f"no file matches {pattern!r}; {check}")


def _local_documents(files: list[Path], cfg: DataConfig, render: Optional[Render] = None) -> Iterator[str]:
    """Documents of each file in order, each file read by its suffix."""
    for path in files:
        suffix = path.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            yield from _txt_documents(path)
        elif suffix in XML_SUFFIXES:
            yield from _xml_documents(path, default_text_field(cfg, "xml"))
        else:
            builder = STRUCTURED_BUILDERS[suffix]
            yield from _structured_documents(builder, [path], default_text_field(cfg, builder), str(path), render)


def _txt_documents(path: Path) -> Iterator[str]:
    """A text file as documents of about TXT_DOC_CHARS characters, cut at blank lines."""
    buf: list[str] = []
    size = 0
    try:
        with path.open("r", encoding="utf-8") as f:
            for line in _bounded_text_lines(f, TXT_MAX_LINE_CHARS):
                buf.append(line)
                size += len(line)
                if (size >= TXT_DOC_CHARS and not line.strip()) or size >= 4 * TXT_DOC_CHARS:
                    yield "".join(buf)
                    buf, size = [], 0
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"cannot read {str(path)!r} as UTF-8 (byte {exc.start} of a chunk is invalid); convert it to UTF-8"
        ) from None
    if buf:
        yield "".join(buf)


def _bounded_text_lines(f: Any, limit: int) -> Iterator[str]:
    """The lines of a text file; a line longer than ``limit`` characters comes in pieces of at
    most ``limit``, each ending before a word where there is a break in its second half, so
    memory holds at most ``limit`` characters of a line however long it is."""
    carry = ""
    while chunk := f.readline(limit - len(carry)):
        line, carry = carry + chunk, ""
        if line.endswith("\n") or len(line) < limit:  # a whole line (a short one is the file's last)
            yield line
            continue
        cut = cut_before_word(line, limit // 2, len(line) - 1) or len(line)
        line, carry = line[:cut], line[cut:]  # the rest (under limit / 2) starts the next piece
        yield line
    if carry:
        yield carry


# An XML dump is read in pieces of this many bytes.
XML_READ_BYTES = 1 << 16
# The most bytes read without the parser completing a tag: one start tag (a row's attributes, a
# post's Body among them), one text or one DTD that long is refused. The parser holds it whole,
# several times over, as it does a JSON line (data.json_records.MAX_JSON_RECORD_BYTES, the same
# bound); a Stack Exchange row is a few KiB.
MAX_XML_TAG_BYTES = 64 << 20
# Elements open at once: a Stack Exchange dump nests two (the root and its rows); JSON data has
# the same bound (files.json_text.MAX_JSON_DEPTH). Each open element is held until it ends.
MAX_XML_DEPTH = 256


def _xml_documents(path: Path, field: str) -> Iterator[str]:
    """The ``field`` attribute of every ``<row>`` of a Stack Exchange dump, read incrementally.

    Every element is detached from its parent and cleared once it ends, whatever its name, so
    memory holds only the open elements (at most MAX_XML_DEPTH) and the tag being read (at most
    MAX_XML_TAG_BYTES): clearing only ``<row>`` elements kept every other one (a 141 MB file of
    ``<post>`` elements held 1.5 GB). Rows without the attribute are skipped (dumps omit empty
    ones); if no row has it, the field name is wrong. Entities are expat's: an external one is
    never read, and expansion past its amplification limit is a parse error.
    """
    n_rows, n_with_field, first_attrs = 0, 0, ""
    for elem in _xml_ended_elements(path):
        if elem.tag != "row":
            continue
        n_rows += 1
        first_attrs = first_attrs or ", ".join(elem.attrib)
        text = elem.get(field)
        if text is not None:
            n_with_field += 1
            yield text
    if n_rows and not n_with_field:
        raise ConfigError(
            f"field {field!r} not found in any of the {n_rows:,} rows of {str(path)!r} "
            f"(attributes: {first_attrs}); set --text-field"
        )


def _xml_ended_elements(path: Path) -> Iterator[ET.Element]:
    """Each element of an XML file as it ends, then detached from its parent and cleared (keep
    nothing of it past the next ``next``); a parse error or a bound passed is a ConfigError."""
    parser: ET.XMLPullParser[ET.Element] = ET.XMLPullParser(events=("start", "end"))
    open_elements: list[ET.Element] = []
    pending = 0  # bytes fed since the parser last completed a tag
    with path.open("rb") as f:  # bytes: the parser honours the XML encoding declaration
        while True:
            chunk = f.read(XML_READ_BYTES)
            if chunk:
                parser.feed(chunk)
            else:
                parser.close()
            pending += len(chunk)
            for event, elem in _xml_events(parser, path):
                pending = 0
                if event == "start":
                    open_elements.append(elem)
                    if len(open_elements) > MAX_XML_DEPTH:
                        raise ConfigError(f"{str(path)!r} nests XML elements deeper than {MAX_XML_DEPTH} levels; "
                                          "a Stack Exchange dump nests two (<posts><row .../></posts>)")
                    continue
                open_elements.pop()
                yield elem
                # The parent lets go of it. Events come once a piece is parsed, so the parent may
                # hold later siblings already; children end in order, so this one is its first.
                if open_elements and len(open_elements[-1]) and open_elements[-1][0] is elem:
                    del open_elements[-1][0]
                elem.clear()
            if pending > MAX_XML_TAG_BYTES:
                offset = f.tell() - pending
                raise ConfigError(f"{str(path)!r} holds a tag, a text or a DTD longer than {MAX_XML_TAG_BYTES >> 20} "
                                  f"MiB from byte {offset:,}; a Stack Exchange row is a few KiB, check that the file "
                                  "is an XML dump")
            if not chunk:
                return


def _xml_events(parser: ET.XMLPullParser[ET.Element], path: Path) -> Iterator[tuple[str, Any]]:
    """The parser's events so far, its parse error as the ConfigError naming the position."""
    try:
        for event in parser.read_events():
            # Only "start" and "end" were asked for, each (event, element); the stubs' union of
            # every event also holds 1-tuples.
            yield event[0], event[1]  # type: ignore[misc]
    except ET.ParseError as exc:
        raise ConfigError(_xml_error(path, exc)) from None


def _xml_error(path: Path, exc: ET.ParseError) -> str:
    line, column = exc.position
    reason = str(exc).split(": line ")[0]  # the position is reported separately
    return (
        f"cannot parse XML in {str(path)!r} at line {line}, column {column}: {reason}; "
        f"check that the file is a complete XML dump"
    )


# --------------------------------------------------------------------------- Hugging Face
def _parse_hf(data: str) -> tuple[str, str]:
    """Split ``hf:...`` into (kind, target): ('hub', NAME), ('dir', PATH) or (builder, GLOB)."""
    spec = data[len("hf:"):]
    if not spec:
        raise ConfigError(
            "--data hf: needs a dataset name, e.g. hf:mikex86/stackoverflow-posts or hf:json:'data/*.jsonl'"
        )
    builder, sep, rest = spec.partition(":")
    if sep and builder in HF_BUILDERS:
        return builder, rest
    if Path(spec).expanduser().is_dir():
        check_dataset_folder(Path(spec).expanduser(), data)
        return "dir", str(Path(spec).expanduser())
    if spec.startswith((".", "/", "~")):  # a path, never a Hub name (OWNER/NAME)
        raise ConfigError(f"no directory {spec!r}; check --data hf:{spec} (a local dataset folder or a Hub name)")
    return "hub", spec


def check_dataset_folder(folder: Path, data: str) -> None:
    """Refuse a dataset folder that ``datasets`` must not read: one holding a Python file (a
    dataset loading script, which some ``datasets`` versions run and others reject with an
    exception) or anything but regular files inside it (a FIFO would block the run forever)."""
    entries = list(visible_entries(folder, recursive=True))
    # pathlib's glob matches hidden names too: a folder .ds is scripted by .ds/.ds.py
    scripts = sorted({*(p for p in entries if p.suffix == ".py"), *folder.glob("*.py")})
    if scripts:
        raise ConfigError(f"--data {data}: {str(scripts[0].relative_to(folder))!r} is a dataset loading script; "
                          "memtrain never runs dataset code, give a folder of data files (.jsonl, .parquet, .csv)")
    for entry, why in folder_entry_problems(folder, entries):
        raise ConfigError(f"--data {data}: {str(entry.relative_to(folder))!r} is {why}; a dataset folder may hold "
                          "only regular files inside it, remove or replace that entry")


def _hf_documents(cfg: DataConfig, render: Optional[Render] = None) -> Iterator[str]:
    """Documents of an ``hf:`` source: a Hub data set streamed, a ``save_to_disk`` folder through
    ``datasets.load_from_disk``, other local files through ``datasets.load_dataset``."""
    kind, target = _parse_hf(cfg.data)
    if kind == "hub":
        yield from _hub_documents(target, cfg, render)
    elif kind == "dir":
        root = Path(target)
        files = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p, root))
        check_json_nesting([p for p in files if p.suffix.lower() in JSON_SUFFIXES])
        check_csv_records([p for p in files if p.suffix.lower() == ".csv"])
        load = _load_saved if is_saved_dataset(root) else _load_dataset
        ds = load(target, split=cfg.hf_split, label=target)
        yield from _dataset_texts(ds, default_text_field(cfg, "text"), target, render=render)
    else:
        for path in _match_files(target, cfg.data):
            yield from _structured_documents(kind, [path], default_text_field(cfg, kind), str(path), render)


def is_saved_dataset(folder: Path) -> bool:
    """Whether ``folder`` was written by ``Dataset.save_to_disk`` (state.json and dataset_info.json
    beside Arrow files) or ``DatasetDict.save_to_disk`` (dataset_dict.json, a folder per split)."""
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file())


# The JSON files of a save_to_disk folder are small (a few KiB); one larger is not datasets'.
MAX_SAVED_JSON_BYTES = 16 << 20


def _saved_json(path: Path, label: str) -> dict[str, Any]:
    """A save_to_disk folder's JSON file (state.json, dataset_info.json, dataset_dict.json) as an
    object, else ConfigError naming it. Read by the one bounded reader of JSON files
    (:func:`memtrain.files.json_file.read_json_file`): a FIFO in the folder blocked the run for ever
    (its size, 0, passed the bound), a link out of the folder was followed."""
    try:
        value = read_json_file(path, MAX_SAVED_JSON_BYTES, root=path.parent)
        why = "" if isinstance(value, dict) else f", a JSON {type(value).__name__}"
    except JsonFileProblem as exc:
        value, why = None, f" ({exc})"
    if not isinstance(value, dict):
        raise ConfigError(f"cannot load {label!r} (a save_to_disk folder): {path.name} is not the JSON object datasets "
                          f"writes{why}; save the dataset again or give its data files")
    return value


def _plain_name(name: Any) -> bool:
    """Whether ``name`` names an entry of its folder by name alone (no path, no "..")."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


def check_saved_dataset(folder: Path, label: str) -> None:
    """The JSON of a save_to_disk folder, checked before ``datasets`` reads it: each file an object,
    dataset_dict.json's splits and state.json's ``_data_files`` named by plain names, so that the
    data read is the folder's own files (a state.json naming ``../../x`` had datasets open a file
    outside it), and a wrong shape is one line (it was datasets' TypeError or AttributeError, exit 1)."""
    if (folder / "dataset_dict.json").is_file():
        splits = _saved_json(folder / "dataset_dict.json", label).get("splits")
        if not isinstance(splits, list) or not all(_plain_name(s) for s in splits):
            raise ConfigError(f"cannot load {label!r} (a save_to_disk folder): dataset_dict.json's splits must "
                              "name its split folders; save the dataset again")
        folders = [folder / s for s in splits if (folder / s).is_dir()]
    else:
        folders = [folder]
    for split in folders:
        _saved_json(split / "dataset_info.json", label)
        files = _saved_json(split / "state.json", label).get("_data_files")
        if not isinstance(files, list) or not all(isinstance(f, dict) and _plain_name(f.get("filename"))
                                                  for f in files):
            raise ConfigError(f"cannot load {label!r} (a save_to_disk folder): {split.name}/state.json's _data_files "
                              "must name the folder's own .arrow files; save the dataset again")


def _load_saved(path: str, *, split: str, label: str) -> Any:
    """``datasets.load_from_disk`` (Arrow files, memory-mapped; no code is run) of a saved dataset,
    ``split`` of a saved DatasetDict; its failures as ConfigError."""
    check_saved_dataset(Path(path), label)
    # Imported here: it takes about a second, only these sources need it (extra memtrain[hub]).
    datasets = import_extra("datasets")
    import_extra("pyarrow")
    quiet_datasets()
    try:
        ds = datasets.load_from_disk(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, datasets.exceptions.DatasetsError) as exc:
        raise ConfigError(f"cannot load {label!r} (a save_to_disk folder): {first_line(exc)}; check --data") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"{label!r} has no split {split!r} (splits: {', '.join(ds)}); set --hf-split")
        ds = ds[split]
    return ds


def _hub_documents(name: str, cfg: DataConfig, render: Optional[Render] = None) -> Iterator[str]:
    """A dataset streamed from the Hugging Face Hub, with network failures as ConfigError."""
    field = default_text_field(cfg, name)
    ds = _load_dataset(name, split=cfg.hf_split, label=name, hub=True)
    try:
        yield from _dataset_texts(ds, field, name, render=render)
    except ConnectionError as exc:
        raise ConfigError(_hub_unreachable(name, exc)) from None


def _structured_documents(builder: str, files: list[Path], field: str, label: str,
                          render: Optional[Render] = None) -> Iterator[str]:
    """Texts of local .jsonl/.json/.parquet/.csv files via the ``datasets`` packaged builders."""
    # An empty file makes the datasets builders end with a bare StopIteration (a RuntimeError
    # inside this generator); it holds no documents, so leave it out and say so if none remain.
    files = [p for p in files if p.stat().st_size > 0]
    if not files:
        raise ConfigError(f"{label!r} is empty (0 bytes); check --data")
    if builder == "parquet":
        yield from _dataset_texts(_parquet_records(files), field, label, render=render)
        return
    if builder == "csv":
        check_csv_records(files)
    locate = None
    if builder == "json":
        check_json_nesting(files)
        check_json_records(files)
        locate = functools.partial(first_bad_json_line, files, label)
    ds = _load_dataset(builder, data_files=[str(p) for p in files], split="train", label=label)
    yield from _dataset_texts(ds, field, label, locate, render)



def check_csv_records(files: list[Path]) -> None:
    """Refuse a CSV record (a line, or the lines of a quoted field that spans several) longer than
    ``json_records.MAX_JSON_RECORD_BYTES`` (a JSON line's bound), naming the file and the line it
    starts on, before datasets' reader (pandas) sees it: it holds a record whole, several times over (a 100 MB field grew the
    process by 317 MB; a 1 GB one, by gigabytes), as the JSON readers hold a line. Python's csv
    reader finds where records end (quoting as pandas reads it); it is given lines of bounded
    length, so no more than the bound is held here either."""
    for path in files:
        with path.open("r", encoding="utf-8", errors="replace", newline="") as fh:
            record = _CsvRecordBytes(path, fh)
            previous = csv.field_size_limit()
            # The default (128 KiB) is a real field's size; the record's bound below comes first.
            csv.field_size_limit(json_records.MAX_JSON_RECORD_BYTES)
            try:
                _scan_csv_records(record)
            finally:
                csv.field_size_limit(previous)


def _scan_csv_records(record: _CsvRecordBytes) -> None:
    """Read every record of ``record``'s file (for their sizes). A line Python's reader calls
    malformed is left to datasets' reader to name, in its words; the scan goes on after it."""
    while True:
        try:
            for _ in csv.reader(record):
                record.start_next()
            return
        except csv.Error:
            record.start_next()


class _CsvRecordBytes:
    """The lines of a CSV file for :func:`csv.reader`, counting the characters of the record being
    read; past ``json_records.MAX_JSON_RECORD_BYTES`` (one line, or the lines of one record) a ConfigError."""

    def __init__(self, path: Path, fh: Any) -> None:
        self.path, self.fh = path, fh
        self.size, self.line, self.first_line = 0, 0, 1

    def start_next(self) -> None:
        """The reader returned a record: the next one starts on the next line."""
        self.size, self.first_line = 0, self.line + 1

    def __iter__(self) -> Iterator[str]:
        while line := self.fh.readline(json_records.MAX_JSON_RECORD_BYTES + 1):
            self.line += 1
            self.size += len(line)
            if self.size > json_records.MAX_JSON_RECORD_BYTES:
                raise ConfigError(f"{str(self.path)!r}: the record on line {self.first_line} is longer than "
                                  f"{json_records.MAX_JSON_RECORD_BYTES >> 20} MiB, more than memtrain reads as one record (its "
                                  "reader holds a record whole, several times over); split it into records, or give "
                                  "the text as a .txt file (read in pieces)")
            yield line

# Rows decoded at a time from a parquet file. datasets' parquet builder decodes a whole row group
# at once, and a row group's size on disk says nothing of its size decoded: a 530-byte file (one
# 1 MB string, dictionary-encoded, repeated in 1,500 rows) held 2.8 GB before its first record
# (15,000 rows would be 15 GB). pyarrow's ParquetFile decodes page by page, PARQUET_BATCH_ROWS
# rows at a time, so memory follows the rows in hand, not the row group.
PARQUET_BATCH_ROWS = 64


def _parquet_records(files: list[Path]) -> Iterator[dict[str, Any]]:
    """The rows of local parquet files as dicts (the records datasets' builder gives), decoded
    PARQUET_BATCH_ROWS at a time. pyarrow's errors (a file that is not parquet, a corrupt page)
    come from the first ``next`` and are said by :func:`_dataset_texts` as datasets' are."""
    import_extra("pyarrow")  # the extra memtrain[hub]; a line naming it where it is missing
    # Imported here: only parquet sources need it, and pyarrow takes a moment to import.
    import pyarrow.parquet as pq

    for path in files:
        with pq.ParquetFile(path) as parquet:
            for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS):
                yield from batch.to_pylist()


def _load_dataset(path: str, *, split: str, label: str, hub: bool = False, **kwargs: Any) -> Any:
    """``datasets.load_dataset(..., streaming=True)`` with its failures turned into ConfigError."""

    # Imported here: it takes about a second, only these sources need it (extra memtrain[hub]).
    datasets = import_extra("datasets")
    import_extra("pyarrow")
    quiet_datasets()  # its own log of a failure would come beside our error: line

    if "trust_remote_code" in inspect.signature(datasets.load_dataset).parameters:
        kwargs["trust_remote_code"] = False  # datasets < 4 can run a Hub dataset's script; never
    offline = hub_offline(datasets)
    if hub and not offline:
        check_hub_reachable(label, datasets)
    try:
        with _datasets_offline(datasets, offline):
            return datasets.load_dataset(path, split=split, streaming=True, **kwargs)
    except ConnectionError as exc:
        raise ConfigError(_hub_unreachable(label, exc, datasets.config.HF_ENDPOINT, offline=offline)) from None
    except datasets.exceptions.DatasetNotFoundError:
        raise ConfigError(
            f"dataset {label!r} not found on the Hugging Face Hub; check the name in --data hf:{label}"
        ) from None
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise ConfigError(f"{label!r}: {first_line(exc)}; set --hf-split") from None
        raise ConfigError(f"cannot read {label!r}: {first_line(exc)}; check --data") from None
    except (OSError, datasets.exceptions.DatasetsError) as exc:
        hint = "check the connection or pass a local file" if hub else "check --data"
        raise ConfigError(f"cannot load {label!r}: {first_line(exc)}; {hint}") from None
    except RuntimeError as exc:  # datasets >= 4 raises this for a Hub dataset that is a loading script
        if "script" not in str(exc).lower():
            raise
        raise ConfigError(f"cannot load {label!r}: {first_line(exc)}; memtrain never runs dataset code, "
                          "use a dataset of data files") from None


# Seconds the one reachability request may wait for the Hub, to connect and then for its answer.
# The Hub answers a HEAD in well under a second; a firewall that drops packets never answers.
# HF_HUB_ETAG_TIMEOUT (huggingface_hub's own timeout for this very request) overrides it.
HUB_PROBE_TIMEOUT_S = 5.0


def check_hub_reachable(name: str, datasets: Any) -> None:
    """One HEAD request for Hub dataset ``name``'s card, without retries, before ``datasets`` is
    called; a ConfigError (:func:`_hub_unreachable`) when no answer comes.

    Why: ``datasets.load_dataset`` fetches the card through huggingface_hub's download, which on a
    network error tries six times with back-off (1+2+4+8+8 s): an unreachable Hub (no network, a
    firewall) was about 24 s of silence before the error. The request is the library's own
    (``get_hf_file_metadata``: its session, proxies, token and HF_ENDPOINT; no retry unless asked),
    so nothing here opens a socket itself (memtrain.models.hub_access, for models, opens a TCP
    connection: it cannot tell through a proxy and skips the check there; this request goes
    through the proxy the library uses, and tells a Hub that answers from a host that only
    accepts connections). Any other answer (a 404 for a missing card, a 401 or 403 for a gated
    set) means the Hub is reachable: datasets then goes on as before and says the rest. In offline
    mode (HF_HUB_OFFLINE=1, read as :func:`hub_offline` reads it) nothing is sent: datasets reads
    its cache, as it always did.

    A proxy or gateway that answers 502/503/504 (Bad Gateway, Service Unavailable, Gateway
    Timeout: the Hub behind it did not answer) is no answer from the Hub: datasets retried it as
    it retries a network error (1+2+4+8+8 s of back-off), so it is refused here in the same one line, naming
    the status. 401/403/404 come from the Hub itself, which is reachable."""
    if hub_offline(datasets):
        return
    # Imported here: it comes with datasets (the extra memtrain[hub]), which only these sources need.
    import huggingface_hub
    from huggingface_hub.utils import HfHubHTTPError  # exported here by every version datasets >= 2.19 takes

    endpoint = datasets.config.HF_ENDPOINT
    url = huggingface_hub.hf_hub_url(name, datasets.config.REPOCARD_FILENAME, repo_type="dataset", endpoint=endpoint)
    try:
        huggingface_hub.get_hf_file_metadata(url, timeout=_hub_probe_timeout(), endpoint=endpoint)
    except HfHubHTTPError as exc:  # an answer (it is an OSError too: caught before the network errors below)
        status = _gateway_status(exc)
        if status is not None:
            raise ConfigError(_hub_unreachable(name, exc, endpoint, reason=_gateway_reason(status))) from None
        return  # the Hub answered: datasets goes on and names a missing or gated set in its own words
    except ValueError:
        return  # a name or URL huggingface_hub's checks refuse: datasets names it in its own words
    except _network_errors() as exc:
        raise ConfigError(_hub_unreachable(name, exc, endpoint)) from None


# What a proxy or gateway answers when the server behind it does not: Bad Gateway, Service
# Unavailable, Gateway Timeout. huggingface_hub retries these as it retries a network error.
GATEWAY_STATUSES = frozenset({502, 503, 504})


def _gateway_status(exc: BaseException) -> Optional[int]:
    """The HTTP status of ``exc``'s response when it is one of GATEWAY_STATUSES, else None (the
    response is ``exc.response`` in huggingface_hub's HTTP error of every version)."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if status in GATEWAY_STATUSES else None


def _gateway_reason(status: int) -> str:
    """The words for a gateway's answer: the status, its name, and what it means here."""
    return (f"the endpoint answered {status} {http.HTTPStatus(status).phrase}, a proxy's or gateway's answer when the "
            "Hub behind it cannot be reached")


def hub_offline(datasets: Any) -> bool:
    """Whether the Hub is not to be asked: datasets' offline switch (``datasets.config.HF_HUB_OFFLINE``),
    or the environment's as it is now. datasets reads the environment once, when it is imported, so
    HF_HUB_OFFLINE=1 set afterwards (in a notebook, a test, a wrapper script) went unseen and the Hub
    was asked. Read as datasets reads it: HF_DATASETS_OFFLINE where set, else HF_HUB_OFFLINE or
    TRANSFORMERS_OFFLINE (huggingface_hub's own variables), true when huggingface_hub's
    ``ENV_VARS_TRUE_VALUES`` hold it upper-cased (1, ON, YES, TRUE)."""
    if datasets.config.HF_HUB_OFFLINE:
        return True
    # Imported here: it comes with datasets (the extra memtrain[hub]), which only these sources need.
    from huggingface_hub import constants

    value = os.environ.get("HF_DATASETS_OFFLINE")
    if value is None:
        value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value is not None and value.upper() in constants.ENV_VARS_TRUE_VALUES


@contextlib.contextmanager
def _datasets_offline(datasets: Any, offline: bool) -> Iterator[None]:
    """datasets' offline switch on while ``load_dataset`` resolves a dataset, when the environment
    set it after datasets read it (:func:`hub_offline`): the library then reads its cache and sends
    nothing, as it would have had the variable been set before its import. datasets has no
    per-call switch for this (its ``DownloadConfig(local_files_only=True)`` does not reach the
    card's download), so its own module constant is set, and put back after."""
    if not offline or datasets.config.HF_HUB_OFFLINE:
        yield
        return
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = False


def _hub_probe_timeout() -> float:
    """HUB_PROBE_TIMEOUT_S, or HF_HUB_ETAG_TIMEOUT where the user set it (huggingface_hub's knob
    for how long its metadata request waits: a slow link or mirror needs more). Read as the
    library reads it (its parsed constant, set where it differs from the default), so that one
    value means the same to both."""
    # Imported here: it comes with datasets (the extra memtrain[hub]), which only hub sources need.
    from huggingface_hub import constants

    if constants.HF_HUB_ETAG_TIMEOUT != constants.DEFAULT_ETAG_TIMEOUT:
        return float(constants.HF_HUB_ETAG_TIMEOUT)
    return HUB_PROBE_TIMEOUT_S


def _network_errors() -> tuple[type[BaseException], ...]:
    """What a request that got no answer raises: OSError (requests' errors in huggingface_hub < 1,
    OfflineModeIsEnabled, socket errors) and the transport errors of the HTTP library huggingface_hub
    sends with (``huggingface_hub.utils.httpx``: httpx or its fork httpx2, by version)."""
    errors: list[type[BaseException]] = [OSError]
    try:
        from huggingface_hub.utils import httpx  # local: the hub's HTTP library, where it names one
        errors.append(httpx.TransportError)
    except (ImportError, AttributeError):
        pass
    return tuple(errors)


def _hub_unreachable(name: str, exc: BaseException, endpoint: Optional[str] = None, offline: bool = False,
                     reason: Optional[str] = None) -> str:
    """The one line for a Hub dataset that could not be read for want of an answer: what was
    tried (the endpoint, the library's reason, or ``reason`` in its place) and what to do.
    ``offline``: HF_HUB_OFFLINE was set and the dataset is not in the datasets cache."""
    if offline:
        return (f"{name!r} is not in the datasets cache and HF_HUB_OFFLINE is set, so the Hub was not asked "
                f"({first_line(exc)}); unset HF_HUB_OFFLINE to stream it, or download the data and pass a local "
                f"file (e.g. --data posts.parquet or --data hf:parquet:'data/*.parquet')")
    where = f" at {endpoint}" if endpoint else ""
    return (
        f"cannot reach the Hugging Face Hub{where} for {name!r} ({reason or first_line(exc) or type(exc).__name__}); download "
        f"the data and pass a local file (e.g. --data posts.parquet or --data hf:parquet:'data/*.parquet'), set "
        f"HF_HUB_OFFLINE=1 to read a copy already in the datasets cache, or HF_ENDPOINT=URL to use a mirror"
    )


def _dataset_texts(ds: Iterable[dict[str, Any]], field: str, label: str,
                   locate: Optional[Callable[[], Optional[str]]] = None,
                   render: Optional[Render] = None) -> Iterator[str]:
    """The ``field`` of every record; a missing field or a non-text value is a ConfigError.
    ``render`` (a --data-format other than text) makes a record's document instead, where it
    returns one.

    Records are pulled one at a time inside ``try`` so that a parse error in the file
    becomes a ConfigError, while errors raised by the consumer are left alone. ``locate``
    (local JSON files) names the line that failed, 1-based, in place of pyarrow's row.
    """
    import datasets
    import pyarrow as pa

    records = iter(ds)
    for index in itertools.count(1):
        try:
            record = next(records)
        except StopIteration:
            return
        except ConnectionError:
            raise
        except (ValueError, OSError, pa.ArrowException, datasets.exceptions.DatasetsError) as exc:
            raise ConfigError(_unreadable(label, exc, locate)) from None
        rendered = render(record, index, label) if render is not None else None
        if rendered is not None:
            yield rendered
            continue
        if field not in record:
            raise ConfigError(
                f"field {field!r} not found in record {index} of {label!r} "
                f"(fields: {', '.join(map(str, record))}); set --text-field" + _instruction_hint(record)
            )
        if index == 1:
            _warn_part_of_a_record(field, record)
        text = record[field]
        if text is None:
            continue  # a null or absent value in this record: an empty document
        if not isinstance(text, str):
            raise ConfigError(
                f"field {field!r} in record {index} of {label!r} holds {type(text).__name__}, not text; "
                f"set --text-field to a text field (fields: {', '.join(map(str, record))})" + _instruction_hint(record)
            )
        yield text


# Field names of instruction and chat data sets (Alpaca's, TRL's prompt-completion and
# conversational formats, ShareGPT's): records a causal-LM text field does not describe.
INSTRUCTION_FIELDS = frozenset({"messages", "conversations", "prompt", "completion", "response", "instruction",
                                "output", "chosen", "rejected"})


def _instruction_hint(record: dict[str, Any]) -> str:
    """What memtrain does with instruction or chat records, when ``record`` looks like one: TRL's
    conversational and prompt-completion records are read with ``--data-format``; other
    instruction records (Alpaca's instruction/output) need their text written to one field."""
    if not INSTRUCTION_FIELDS & set(map(str, record)):
        return ""
    return ("; for chat records (messages, or ShareGPT's conversations) give --data-format chat, for prompt and "
            "completion fields --data-format prompt-completion (--data-format auto tells them apart), with a --model "
            "whose tokenizer has a chat template; other instruction records: write each one's whole text to one "
            "field and name it with --text-field")


def _warn_part_of_a_record(field: str, record: dict[str, Any]) -> None:
    """One warning when ``field`` is one part of an instruction record (its prompt, its answer):
    the run then trains on that part alone, which a text field cannot tell from the data."""
    others = sorted(INSTRUCTION_FIELDS & set(map(str, record)) - {field})
    if field in INSTRUCTION_FIELDS and others:
        warnings.warn(f"--text-field {field} trains on that field alone; the records also hold {', '.join(others)}"
                      + _instruction_hint(record), PartOfARecordWarning, stacklevel=2)


def _unreadable(label: str, exc: BaseException, locate: Optional[Callable[[], Optional[str]]]) -> str:
    """The line for a file datasets could not read: the failing line when it can be found, else
    the library's message without pyarrow's "in row N" (0-based, and counted within a block)."""
    where = locate() if locate is not None else None
    if where is not None:
        return f"cannot read {label!r}: {where}; fix that line or remove it"
    return f"cannot read {label!r}: {re.sub(r' in row [0-9]+', '', first_line(exc))}; check the file format"


# --------------------------------------------------------------------------- helpers
def _file_stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _hidden(path: Path, root: Path) -> bool:
    """Hidden files and folders (``.cache``, ``.git``) do not hold the dataset's content."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)
