"""Tokenize a source once, split it into train/validation, and keep the tokens on disk.

A cache entry is a directory named by a SHA-256 key of everything that determines its
content (source identity, text options, tokenizer, split settings, FORMAT_VERSION). It
holds ``train.bin`` and ``val.bin`` (uint16 token ids, each document followed by
``<|endoftext|>``), ``train.idx`` and ``val.idx`` (int64: where each document starts in its
split's ids, then the split's length; ``--packing pad`` makes a row of each document) and
``meta.json``. Entries are written into a temporary directory and
renamed into place in one step, so an interrupted run never leaves a half-written entry;
the arrays are memory-mapped on load, so a corpus larger than RAM still trains.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import numpy as np
from tqdm.auto import tqdm

from memtrain.config.run import ConfigError, DataConfig, effective_cache_dir
from memtrain.data.records import RENDER_VERSION, RecordText, make_renderer, template_refusal
from memtrain.data.sources import iter_documents, source_identity
from memtrain.data.tokenizer import (
    ENCODE_PIECE_CHARS,
    EOT_ID,
    N_VOCAB,
    TOKENIZER_NAME,
    default_threads,
    encoding_pieces,
    get_tokenizer,
)
from memtrain.errors import one_line
from memtrain.files.guard import regular_file_problem
from memtrain.files.json_file import read_json_file
from memtrain.runtime.notices import ProgressLines, shows_progress

# Bump when the on-disk layout or the way documents are rendered changes.
FORMAT_VERSION = 1
TOKEN_DTYPE = np.uint16  # GPT-2's 50257 ids fit; half the disk and page cache of int32
BATCH_DOCS = 512  # documents per encode_ordinary_batch call: enough to keep the threads busy
# Characters per encode call (documents, or pieces of a long one): bounds tiktoken's working
# memory and the Python lists of ids it returns (~36 bytes per id until they become an array).
BATCH_CHARS = 1 << 22
SPLITS = ("train", "val")
# Write errors of the cache's own disk that a run without the cache would not meet: full, over
# quota, failing. The entry is dropped and the run tokenizes without it.
CACHE_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})
TMP_PREFIX = ".tmp-"  # entries being written: .tmp-<pid>-<random>

# GPT-2's ids fit TOKEN_DTYPE: an internal invariant of two constants (no input changes it),
# checked by tests/test_data.py rather than by an assert at import that `python -O` would drop.


@dataclass
class TokenSplits:
    """Token ids of the train and validation documents (memory-mapped uint16 arrays)."""

    train: np.ndarray
    val: np.ndarray
    n_train_docs: int
    n_val_docs: int
    from_cache: bool
    tokens_per_s: float | None  # BPE encoding speed of this run; None when read from the cache
    cache_path: str
    tokenizer: str = TOKENIZER_NAME  # the name of the tokenizer that produced the ids (meta.json's)
    # --loss-on completion: 1 where the token is a target (a record's answer), beside each split's
    # ids (memory-mapped uint8); None when every token is one.
    train_mask: Optional[np.ndarray] = None
    val_mask: Optional[np.ndarray] = None
    # Where each document starts in its split's ids, then the split's length (int64, n_docs + 1):
    # the boundaries the tokenizing drew (a chat template may write an eos inside a record, so they
    # are never searched for). None for an entry written before they were stored.
    train_offsets: Optional[np.ndarray] = None
    val_offsets: Optional[np.ndarray] = None


def prepare_tokens(cfg: DataConfig, progress: Optional[bool] = None, tokenizer: Any = None,
                   lines: bool = False, whole: bool = False, named: Optional[str] = None) -> TokenSplits:
    """Tokens of ``cfg.data``, split by document; read from the cache when an entry exists.

    ``cfg.no_cache`` tokenizes again and replaces the entry. ``progress`` shows a tqdm bar
    (documents, tokens/s) on stderr while tokenizing (None: only on a terminal); ``lines``, where
    no bar is drawn, a plain line now and then (:class:`memtrain.runtime.notices.ProgressLines`). ``tokenizer`` (None: GPT-2 BPE) is a
    model's own tokenizer (memtrain.models.tokenizer.HFTokenizer: ``name``, ``n_vocab``,
    ``eot_id``, ``encode_batch``); ids that do not fit uint16 are stored as uint32. ``whole``: no
    document is held out (every one in ``train``; a source of its own validates, --val-data), an
    entry of its own whatever --val-fraction and --split-seed say. ``named``: the source in the
    bar's and the plain lines' words (default ``--data DATA``): a run with a validation source of its own
    tokenizes twice, and both phases' lines said only "tokenizing".
    """
    if cfg.data_format == "chat" and (refusal := template_refusal(cfg.data_format, tokenizer)) is not None:
        raise refusal  # said before the cache is looked at: a rendered entry needs the template
    root = cache_root(cfg)
    final = root / cache_key(cfg, tokenizer, whole)
    if not cfg.no_cache:
        cached = _load_entry(final, from_cache=True, expected=_identity(cfg, tokenizer))
        # An entry written before the record offsets were stored serves --packing concat as ever;
        # --packing pad needs them, so it tokenizes again and replaces the entry (same key, same ids).
        if cached is not None and (cfg.packing != "pad" or cached.train_offsets is not None):
            return cached
    try:
        root.mkdir(parents=True, exist_ok=True)
        _clean_stale_tmp(root)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-", dir=root))
    except OSError as exc:
        return _tokenize_uncached(cfg, root, exc, progress, tokenizer, lines, whole, named)
    try:
        meta = _write_tokens(cfg, tmp, progress, tokenizer, lines, whole, named)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))  # written last: marks a complete entry
        _publish(tmp, final)
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            # The file size limit (ulimit -f) binds every file this process writes: tokenizing
            # without the cache writes the same arrays to another folder. Said naming the cache
            # (the write's own error names no file).
            raise OSError(exc.errno, exc.strerror, str(root)) from None
        if exc.errno not in CACHE_FULL:
            raise
        # The cache's disk filled (or failed) while the entry was written: the cache only saves
        # time, so the run goes on as with an unwritable cache (the folder is cleaned first).
        shutil.rmtree(tmp, ignore_errors=True)
        return _tokenize_uncached(cfg, root, exc, progress, tokenizer, lines, whole, named)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; cleans up after a failure
    splits = _load_entry(final, from_cache=False)
    if splits is None:
        # A real event, not an invariant: another process may replace or remove the entry between
        # the rename and this read (a concurrent run's publish of the same key, a cache cleaner).
        raise OSError(errno.ENOENT, "the token cache entry could not be read back right after it was written "
                      "(another process replaced or removed it); run again, or set MEMTRAIN_CACHE to a folder "
                      "of this run's own", str(final))
    return splits


def _tokenize_uncached(cfg: DataConfig, root: Path, exc: OSError, progress: Optional[bool], tokenizer: Any,
                       lines: bool = False, whole: bool = False, named: Optional[str] = None) -> TokenSplits:
    """Tokenize into a private temporary folder when the cache cannot be written (read-only
    file system, a file in the way, no permission): the run goes on, only slower next time.
    ``tokenizer`` is the same one a cached entry would be built with (None: GPT-2 BPE), so the
    ids never depend on whether the cache could be written."""

    # mkdir says "File exists" (or "Not a directory") of a file where the folder goes: name it.
    why = "a file is in its path" if exc.errno in (errno.EEXIST, errno.ENOTDIR) else exc.strerror or type(exc).__name__
    print(f"warning: token cache {str(root)!r} is not writable ({why}); "
          "tokenizing without a cache (set MEMTRAIN_CACHE to a writable folder)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix="memtrain-tokens-"))
    try:
        meta = _write_tokens(cfg, tmp, progress, tokenizer, lines, whole, named)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        splits = _load_entry(tmp, from_cache=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the memmaps stay readable after the unlink (POSIX)
    if splits is None:
        # Nothing else writes this private folder: the ids themselves failed the reader's checks
        # (an id at or past the tokenizer's n_vocab, a size that differs), a fault to report.
        raise RuntimeError(f"the tokens written to {str(tmp)!r} do not read back as written (an id past the "
                           "tokenizer's vocabulary, or a size that differs); report it with the --data and --model used")
    splits.cache_path = ""
    return splits


def _clean_stale_tmp(root: Path) -> None:
    """Remove ``.tmp-<pid>-*`` folders of writers that died (a SIGKILL skips their cleanup)."""
    for d in root.glob(TMP_PREFIX + "*"):
        pid = d.name[len(TMP_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass


def cache_root(cfg: DataConfig) -> Path:
    """The cache directory: ``$MEMTRAIN_CACHE`` if set, else ``cfg.cache_dir``."""
    return Path(effective_cache_dir(cfg)).expanduser()


def cache_key(cfg: DataConfig, tokenizer: Any = None, whole: bool = False) -> str:
    """SHA-256 of everything that decides the cached tokens (no file content is read); ``whole``
    (nothing held out) keys no split settings, so a source's whole entry serves any run."""
    payload = {
        "format_version": FORMAT_VERSION,
        "source": source_identity(cfg),
        "text_field": cfg.text_field,
        "strip_html": cfg.strip_html,
        "max_documents": cfg.max_documents,
        "hf_split": cfg.hf_split,
        "tokenizer": {"name": TOKENIZER_NAME, "n_vocab": N_VOCAB} if tokenizer is None
        else _tokenizer_meta(tokenizer),
        "val_fraction": 0.0 if whole else cfg.val_fraction,
        "split_seed": None if whole else cfg.split_seed,
        **_format_identity(cfg, tokenizer),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _format_identity(cfg: DataConfig, tokenizer: Any) -> dict[str, Any]:
    """What a --data-format other than text adds to the key: the format and a SHA-256 of the
    chat template that renders its records (the tokenizer's identity hashes its files, not a
    chat_template.jinja beside them, and a changed template must not reuse the old ids). Empty
    for text, so text entries keep their keys."""
    if cfg.data_format == "text":
        return {}
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    digest = hashlib.sha256(template.encode()).hexdigest() if template else None
    # --loss-on completion writes a target mask beside the ids (its entries alone hold one).
    answers = {"loss_on": cfg.loss_on} if cfg.loss_on != "all" else {}
    # How records become text: a cached entry of an older rendering (before tools reached the
    # template) must not be reused.
    # --chat-template-kwargs change what the template writes (Qwen3's enable_thinking); keyed only
    # when given, so entries made without them keep their keys.
    kwargs = {"chat_template_kwargs": cfg.chat_template_kwargs} if cfg.chat_template_kwargs else {}
    return {"data_format": cfg.data_format, "chat_template": digest, "render_version": RENDER_VERSION, **answers,
            **kwargs}


def assign_validation(rng: np.random.Generator, n_docs: int, val_fraction: float) -> np.ndarray:
    """Which of the next ``n_docs`` documents go to validation: one uniform draw each, in order.

    ``rng.random(n)`` yields the same numbers as ``n`` calls of ``rng.random()``, so the split
    depends only on the seed and the document order, never on how documents are batched;
    a streamed source therefore splits identically on every run.
    """
    return rng.random(n_docs) < val_fraction


# --------------------------------------------------------------------------- writing
def _token_dtype(n_vocab: int) -> np.dtype:
    return np.dtype(TOKEN_DTYPE) if n_vocab <= np.iinfo(TOKEN_DTYPE).max + 1 else np.dtype(np.uint32)


def _write_tokens(cfg: DataConfig, out: Path, progress: Optional[bool], tokenizer: Any = None,
                  lines: bool = False, whole: bool = False, named: Optional[str] = None) -> dict[str, Any]:
    """Tokenize the source into ``out/train.bin`` and ``out/val.bin``; return the metadata.
    ``named``: the source in the plain lines' words (None: ``--data DATA``)."""
    rng = np.random.default_rng(cfg.split_seed)
    threads = default_threads()
    if tokenizer is None:
        gpt2 = get_tokenizer()  # built before the clock starts: tokens/s measures encoding only
        encode = lambda texts: gpt2.encode_ordinary_batch(texts, num_threads=threads)  # noqa: E731
    else:
        encode = tokenizer.encode_batch
    tok_meta = _tokenizer_meta(tokenizer)
    dtype = _token_dtype(tok_meta["n_vocab"])
    started = source_identity(cfg)  # the files as reading starts: the entry records these
    docs = {s: 0 for s in SPLITS}
    tokens = {s: 0 for s in SPLITS}
    encode_s = 0.0
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        files: dict[str, BinaryIO] = {s: stack.enter_context(open(out / f"{s}.bin", "wb")) for s in SPLITS}
        offset_files = {s: stack.enter_context(open(out / f"{s}.idx", "wb")) for s in SPLITS}
        masked = cfg.loss_on == "completion"
        mask_files = {s: stack.enter_context(open(out / f"{s}.mask", "wb")) for s in SPLITS} if masked else {}
        targets = {s: 0 for s in SPLITS}
        drawn = shows_progress(progress)
        # The bar and the plain lines name the source alike: with --val-data, two phases tokenize.
        phase = f"tokenizing {one_line(named or '--data ' + cfg.data)}"
        bar = stack.enter_context(
            tqdm(total=cfg.max_documents, unit="doc", desc=phase, disable=not drawn, dynamic_ncols=True)
        )
        # Entered: a failed batch stops its heartbeat, with no closing line (close() below writes it).
        said = stack.enter_context(
            ProgressLines(phase, lines and not drawn, total=cfg.max_documents, unit="documents"))
        for batch in _batched(_documents(cfg, tokenizer), BATCH_DOCS, BATCH_CHARS):
            is_val = assign_validation(rng, len(batch), 0.0 if whole else cfg.val_fraction)
            t0 = time.perf_counter()
            if masked:
                encoded, doc_masks = _encode_masked(tokenizer, batch, dtype)
            else:
                encoded = _encode_documents(encode, batch, dtype)
            encode_s += time.perf_counter() - t0
            for split, chosen in (("train", ~is_val), ("val", is_val)):
                kept = [d for d, c in zip(batch, chosen) if c]
                records = _framed_records([e for e, c in zip(encoded, chosen) if c], tok_meta["eot_id"], dtype,
                                          tok_meta.get("prefix_ids", ()), [_templated(d) for d in kept])
                ids = np.concatenate(records) if records else np.zeros(0, dtype)
                files[split].write(ids.tobytes())
                offset_files[split].write(_record_starts(records, tokens[split]).tobytes())
                if masked:
                    mask = _concat_masks([m for m, c in zip(doc_masks, chosen) if c], kept,
                                         [e for e, c in zip(encoded, chosen) if c], tok_meta["eot_id"],
                                         len(tok_meta.get("prefix_ids", ())))
                    _check_mask_frames_ids(mask, ids)
                    mask_files[split].write(mask.tobytes())
                    targets[split] += int(mask.sum())
                docs[split] += int(chosen.sum())
                tokens[split] += len(ids)
            bar.update(len(batch))
            tokens_per_s = f"{sum(tokens.values()) / max(encode_s, 1e-9):,.0f}"
            bar.set_postfix(tok_s=tokens_per_s, refresh=False)
            said.update(said.done + len(batch), f"{tokens_per_s} tokens/s")
        said.close()
        for split in SPLITS:  # each split's offsets end with its length: a row's end is the next start
            offset_files[split].write(np.array([tokens[split]], dtype=np.int64).tobytes())
    _refuse_changed_source(cfg, started)
    return {
        "format_version": FORMAT_VERSION,
        "source": started,
        "data": cfg.data,
        "tokenizer": tok_meta,
        **_format_identity(cfg, tokenizer),
        "dtype": dtype.name,
        "n_train_docs": docs["train"],
        "n_val_docs": docs["val"],
        "n_train_tokens": tokens["train"],
        "n_val_tokens": tokens["val"],
        **({"n_train_targets": targets["train"], "n_val_targets": targets["val"]} if masked else {}),
        "record_offsets": True,  # train.idx and val.idx are in the entry (not in the key: the ids are the same)
        "tokens_per_s": sum(tokens.values()) / max(encode_s, 1e-9),
        "encode_s": encode_s,
        "elapsed_s": time.perf_counter() - start,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _refuse_changed_source(cfg: DataConfig, started: dict[str, Any]) -> None:
    """A ConfigError when ``--data``'s files changed while they were tokenized (replaced, edited,
    a file added to a glob or removed): the tokens would mix two versions, under the key of the
    first, and the entry recorded the second. Said before the entry is published."""
    try:
        now = source_identity(cfg)
    except (ConfigError, OSError):  # a file removed meanwhile: changed too
        now = None
    if now != started:
        raise ConfigError(f"--data {cfg.data!r} changed while it was being read (a file replaced, edited, added or "
                          "removed); run again once it has stopped changing")


def _check_mask_frames_ids(mask: np.ndarray, ids: np.ndarray) -> None:
    """A target mask that does not frame its ids one for one would train on the wrong tokens,
    silently: a RuntimeError (not an assert, which ``python -O`` drops) stops the run before the
    entry is written. The two arrays come from the same documents and offsets, so this is a
    fault of memtrain's or the tokenizer's (offsets that are not one per id), not of the input."""
    if len(mask) != len(ids):
        raise RuntimeError(f"a --loss-on completion target mask of {len(mask):,} tokens frames {len(ids):,} ids; "
                           "the tokenizer's offsets do not match its ids: report it with the --model used")


def check_first_document(cfg: DataConfig, tokenizer: Any = None) -> None:
    """Read ``cfg``'s source up to its first document as :func:`prepare_tokens` reads it (a chat
    format's template checked, structured records rendered with ``tokenizer``): a ConfigError
    with the line ``train`` would say when it cannot, without tokenizing anything."""
    if cfg.data_format == "chat" and (refusal := template_refusal(cfg.data_format, tokenizer)) is not None:
        raise refusal
    for _ in _documents(cfg, tokenizer):
        break


def _documents(cfg: DataConfig, tokenizer: Any) -> Iterator[str]:
    """The source's documents; a --data-format other than text renders its records (with their
    answers' spans under --loss-on completion)."""
    if cfg.data_format == "text":
        return iter_documents(cfg)
    return iter_documents(cfg, make_renderer(cfg.data_format, tokenizer, answers=cfg.loss_on == "completion"))


def _templated(doc: str) -> bool:
    """Whether a chat template rendered ``doc`` (it then frames itself: no bos is added)."""
    return isinstance(doc, RecordText) and doc.templated


def _answers(doc: str) -> Optional[tuple[tuple[int, int], ...]]:
    """The character spans of ``doc``'s answers; None for plain text, whose every token is a target."""
    return doc.answers if isinstance(doc, RecordText) else None


def _token_offsets(tokenizer: Any, docs: list[str]) -> list[tuple[list[int], np.ndarray, np.ndarray]]:
    """Each document's ids with each id's start and end character: a model's tokenizer gives
    them with its ids; GPT-2's BPE by decoding its ids with offsets. A document is encoded whole
    (not in pieces), so its offsets hold however its tokens merge."""
    out = []
    if tokenizer is None:
        gpt2 = get_tokenizer()
        for doc in docs:
            ids = gpt2.encode_ordinary(doc)
            starts = np.asarray(gpt2.decode_with_offsets(ids)[1], dtype=np.int64)
            ends = np.append(starts[1:], len(doc)) if len(ids) else starts
            out.append((ids, starts, ends))
        return out
    for ids, offsets in tokenizer.encode_offsets(docs):
        spans = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
        out.append((ids, spans[:, 0], spans[:, 1]))
    return out


def _encode_masked(tokenizer: Any, docs: list[str], dtype: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The ids of each document and its target mask (1: a target, uint8): a token is a target
    when its characters overlap an answer's span (transformers' rule for its assistant masks:
    a token that a boundary cuts counts as the answer's); every token of plain text is one."""
    ids_out, masks = [], []
    for doc, (ids, starts, ends) in zip(docs, _token_offsets(tokenizer, docs)):
        mask = np.ones(len(ids), dtype=np.uint8)
        spans = _answers(doc)
        if spans is not None:
            ends = np.maximum(ends, starts + 1)  # a token of no characters (one a template adds) at its start
            hit = np.zeros(len(ids), dtype=bool)
            for lo, hi in spans:
                hit |= (starts < hi) & (ends > lo)
            mask = hit.astype(np.uint8)
        ids_out.append(np.array(ids, dtype=dtype))
        masks.append(mask)
    return ids_out, masks


def _concat_masks(masks: list[np.ndarray], docs: list[str], encoded: list[np.ndarray], eot_id: int,
                  n_prefix: int) -> np.ndarray:
    """The target mask of :func:`_concat_with_eot`'s array, framed alike: a bos added before a
    document and its closing eos are targets in plain text; in a record with answers the bos
    is not, and the eos is when the record ends with an answer (TRL's completion ends with the
    eos it adds)."""
    parts = []
    for mask, doc, ids in zip(masks, docs, encoded):
        spans = _answers(doc)
        closing = np.array([spans is None or any(hi >= len(doc) for _, hi in spans)], dtype=np.uint8)
        if _templated(doc):
            parts += [mask] if len(ids) and ids[-1] == eot_id else [mask, closing]
        else:
            lead = np.full(n_prefix, 1 if spans is None else 0, dtype=np.uint8)
            parts += [lead, mask, closing]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


Encoder = Any  # list[str] -> list[list[int]]


def _encode_documents(encode: Encoder, docs: list[str], dtype: Any) -> list[np.ndarray]:
    """The ids of each document as an array; a document longer than ENCODE_PIECE_CHARS is
    encoded piece by piece (:func:`memtrain.data.tokenizer.encoding_pieces`), so memory stays
    bounded however long one document is, with the same ids as encoding it whole."""
    short = [d for d in docs if len(d) <= ENCODE_PIECE_CHARS]
    ids = iter(encode(short) if short else [])
    return [np.array(next(ids), dtype=dtype) if len(d) <= ENCODE_PIECE_CHARS else _encode_long(encode, d, dtype)
            for d in docs]


def _encode_long(encode: Encoder, doc: str, dtype: Any) -> np.ndarray:
    """One long document's ids, its pieces encoded BATCH_CHARS characters at a time."""
    parts = [np.array(ids, dtype=dtype) for group in _batched(encoding_pieces(doc, ENCODE_PIECE_CHARS), BATCH_DOCS, BATCH_CHARS)
             for ids in encode(group)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _tokenizer_meta(tokenizer: Any) -> dict[str, Any]:
    """A tokenizer's identity for meta.json (None: GPT-2 BPE) and, of a model's tokenizer, the
    cache key; ``prefix_ids`` (the bos a document starts with) only when there is one, so entries
    of tokenizers without one keep their keys."""
    if tokenizer is None:
        return {"name": TOKENIZER_NAME, "n_vocab": N_VOCAB, "eot_id": EOT_ID}
    meta = {"name": tokenizer.name, "n_vocab": tokenizer.n_vocab, "eot_id": tokenizer.eot_id}
    prefix = list(getattr(tokenizer, "prefix_ids", ()))
    return {**meta, "prefix_ids": prefix} if prefix else meta


def _concat_with_eot(encoded: list[Any], eot_id: int = EOT_ID, dtype: Any = TOKEN_DTYPE,
                     prefix: Sequence[int] = (), templated: Optional[Sequence[bool]] = None) -> np.ndarray:
    """One array: each document's ids, after ``prefix`` (a tokenizer's bos), then the end-of-text id
    (:func:`_framed_records`, joined)."""
    records = _framed_records(encoded, eot_id, dtype, prefix, templated)
    return np.concatenate(records) if records else np.zeros(0, dtype)


def _framed_records(encoded: list[Any], eot_id: int = EOT_ID, dtype: Any = TOKEN_DTYPE,
                    prefix: Sequence[int] = (), templated: Optional[Sequence[bool]] = None) -> list[np.ndarray]:
    """Each document's ids as the stream holds them: after ``prefix`` (a tokenizer's bos), then the
    end-of-text id.

    A ``templated`` document (a record rendered by a chat template, which writes its own bos)
    gets no ``prefix``, and no end-of-text id when its ids already end with one (TRL's rule for
    adding eos): the template closed it."""
    eot = np.array([eot_id], dtype=dtype)
    lead = np.array(prefix, dtype=dtype)
    records = []
    for i, ids in enumerate(encoded):
        ids = np.asarray(ids, dtype=dtype)
        if templated is not None and templated[i]:
            parts = [ids] if len(ids) and ids[-1] == eot_id else [ids, eot]
        else:
            parts = [lead, ids, eot] if len(prefix) else [ids, eot]
        records.append(np.concatenate(parts))
    return records


def _record_starts(records: list[np.ndarray], start: int) -> np.ndarray:
    """Where each of ``records`` starts in its split's ids, the first at ``start`` (int64)."""
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    return start + np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(records) else np.zeros(0, np.int64)


def _batched(items: Iterable[str], n: int, max_chars: Optional[int] = None) -> Iterator[list[str]]:
    """Lists of at most ``n`` items and (``max_chars``) at most that many characters, unless
    one item alone is longer."""
    batch: list[str] = []
    chars = 0
    for item in items:
        if batch and (len(batch) == n or (max_chars is not None and chars + len(item) > max_chars)):
            yield batch
            batch, chars = [], 0
        batch.append(item)
        chars += len(item)
    if batch:
        yield batch


def _publish(tmp: Path, final: Path) -> None:
    """Move a complete entry into place atomically (rename), replacing an older one if any.

    If another process published the same key meanwhile, its entry is kept: both hold the
    same tokens, since the key determines the content.
    """
    if os.path.lexists(final):  # a dangling link too: the rename below failed on it (ENOTDIR)
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(final, old)  # the name itself: a link's target is never touched
            _remove_entry(old)
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / "meta.json").exists():
            raise


def _remove_entry(path: Path) -> None:
    """Remove a replaced entry: a folder with its files, a link or a file by its name only."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(OSError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------- reading
MAX_META_BYTES = 2**20  # the writer's meta.json is under 1 KiB; a larger one is not the writer's


def _identity(cfg: DataConfig, tokenizer: Any) -> dict[str, Any]:
    """What the meta.json of this run's entry records of its source and tokenizer, as JSON reads
    it back (lists for tuples)."""
    return json.loads(json.dumps({"source": source_identity(cfg), "tokenizer": _tokenizer_meta(tokenizer),
                                  **_format_identity(cfg, tokenizer)}))


def _load_entry(entry: Path, from_cache: bool, expected: Optional[dict[str, Any]] = None) -> TokenSplits | None:
    """Open a cache entry, or None when it is missing or inconsistent (it is then rebuilt).

    Its files are checked before any is opened: each must be a regular file of the entry (a FIFO
    planted in a shared cache blocked the run for ever in ``open``; a link to ``/dev/zero`` as
    meta.json was read without end), and meta.json small. With ``expected`` (:func:`_identity`),
    an entry whose meta.json records another source or tokenizer (copied or moved in from
    another key) is not this run's: its ids were used, and result.json named its tokenizer."""
    if any(regular_file_problem(entry / f"{s}.bin", entry) is not None for s in SPLITS):
        return None  # the splits' .bin files are any size
    try:
        meta = read_json_file(entry / "meta.json", MAX_META_BYTES, root=entry)
        sizes = {s: int(meta[f"n_{s}_tokens"]) for s in SPLITS}
        docs = {s: int(meta[f"n_{s}_docs"]) for s in SPLITS}
        tokens_per_s = meta.get("tokens_per_s")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # JsonFileProblem is a ValueError
        return None
    if meta.get("format_version") != FORMAT_VERSION or min(sizes.values()) < 0:
        return None
    if expected is not None and any(meta.get(k) != v for k, v in expected.items()):
        return None
    arrays = {}
    # meta.json is read, not trusted: only the two id widths the writer produces are accepted.
    dtype_name = meta.get("dtype", np.dtype(TOKEN_DTYPE).name)
    if dtype_name not in (np.dtype(TOKEN_DTYPE).name, np.dtype(np.uint32).name):
        return None
    dtype = np.dtype(dtype_name)
    tok = meta.get("tokenizer")
    n_vocab = tok.get("n_vocab") if isinstance(tok, dict) else None
    tok_name = tok.get("name") if isinstance(tok, dict) else None
    if not isinstance(n_vocab, int) or n_vocab <= 0:
        n_vocab = N_VOCAB
    for split in SPLITS:
        path = entry / f"{split}.bin"
        n = sizes[split]
        if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
            return None
        # np.memmap cannot map an empty file; an empty split is an empty array.
        arrays[split] = np.memmap(path, dtype=dtype, mode="r") if n else np.zeros(0, dtype)
        # An id the embedding cannot hold (a corrupted or foreign entry) would crash the first
        # step with an index error; one pass over the tokens (GB/s) rebuilds the entry instead.
        if n and int(arrays[split].max()) >= n_vocab:
            return None
    masks = _load_masks(entry, meta, sizes)
    offsets = _load_offsets(entry, meta, sizes, docs)
    if masks is None or offsets is None:
        return None
    return TokenSplits(
        train=arrays["train"],
        val=arrays["val"],
        n_train_docs=docs["train"],
        n_val_docs=docs["val"],
        from_cache=from_cache,
        tokens_per_s=None if from_cache else tokens_per_s,
        cache_path=str(entry),
        tokenizer=tok_name if isinstance(tok_name, str) else TOKENIZER_NAME,
        train_mask=masks.get("train"),
        val_mask=masks.get("val"),
        train_offsets=offsets.get("train"),
        val_offsets=offsets.get("val"),
    )


def _load_masks(entry: Path, meta: dict[str, Any], sizes: dict[str, int]) -> Optional[dict[str, np.ndarray]]:
    """The entry's target masks ({} for an entry without them: every token a target), or None when
    they are inconsistent with its ids (the entry is then rebuilt). Each must be a regular file of
    the entry, one byte per token, every byte 0 or 1."""
    if "n_train_targets" not in meta:
        return {}
    masks = {}
    for split in SPLITS:
        path, n = entry / f"{split}.mask", sizes[split]
        if regular_file_problem(path, entry) is not None or path.stat().st_size != n:
            return None
        masks[split] = np.memmap(path, dtype=np.uint8, mode="r") if n else np.zeros(0, np.uint8)
        if n and int(masks[split].max()) > 1:
            return None
    return masks


def _load_offsets(entry: Path, meta: dict[str, Any], sizes: dict[str, int],
                  docs: dict[str, int]) -> Optional[dict[str, np.ndarray]]:
    """The entry's record offsets ({} for an entry written before they were stored: --packing pad
    tokenizes again), or None when they are inconsistent with its ids (the entry is then rebuilt).
    Each must be a regular file of the entry holding n_docs + 1 int64 values that start at 0, never
    decrease and end at the split's length: a row cut from them then never reads past the ids."""
    if meta.get("record_offsets") is not True:
        return {}
    offsets = {}
    for split in SPLITS:
        path, n = entry / f"{split}.idx", docs[split] + 1
        if regular_file_problem(path, entry) is not None or path.stat().st_size != n * 8:
            return None
        # Read whole (8 bytes a document, small beside the ids) rather than mapped: checked once here.
        values = np.fromfile(path, dtype=np.int64)
        if values[0] != 0 or values[-1] != sizes[split] or (n > 1 and bool((np.diff(values) < 0).any())):
            return None
        offsets[split] = values
    return offsets
