"""A validation source of its own (``--val-data``, ``--val-split``) beside the training data.

Without one, validation is a seeded share of ``--data``'s documents (``--val-fraction``); with
one, all of ``--data`` trains and validation reads the other source, with the same text options
(``--text-field``, ``--data-format``, ``--loss-on``, chat template, ``--strip-html``), as TRL's
``eval_dataset`` or a hub dataset's ``validation`` split. Each source is tokenized whole into a
token-cache entry of its own (:func:`memtrain.data.cache.prepare_tokens` with ``whole``), so a
second run with the same validation file reads it from the cache, whatever its training data.

Usage::

    splits = prepare_splits(cfg.data)               # TokenSplits: train and val, either way
    check_val_tokens(splits, cfg.data, seq_len)     # one block at least, said of the source
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from memtrain.config.run import ConfigError, DataConfig, val_data_message
from memtrain.data.cache import TokenSplits, prepare_tokens
from memtrain.data.sources import source_identity


def prepare_splits(cfg: DataConfig, progress: Optional[bool] = None, tokenizer: Any = None,
                   lines: bool = False) -> TokenSplits:
    """The train and validation tokens of ``cfg``: :func:`prepare_tokens`' document split of
    ``--data``, or, with a validation source, all of ``--data`` as ``train`` and all of that
    source as ``val`` (a ConfigError about it names --val-data), the validation source read first."""
    val_cfg = cfg.validation_config()
    if val_cfg is None:
        return prepare_tokens(cfg, progress, tokenizer, lines)
    # The validation source first: it is read (a Hub name resolved, every record checked) before
    # --data is tokenized, so an unreadable one is refused in seconds rather than after minutes of
    # tokenizing a large corpus; it is usually the smaller of the two. Each is cached on its own,
    # so the order changes no token.
    try:
        val = prepare_tokens(val_cfg, progress, tokenizer, lines, whole=True, named=validation_source_name(cfg))
    except ConfigError as exc:
        raise ConfigError(val_data_message(str(exc))) from None
    train = prepare_tokens(cfg, progress, tokenizer, lines, whole=True)
    return dataclasses.replace(
        train, val=val.train, n_val_docs=val.n_train_docs, val_mask=val.train_mask, val_offsets=val.train_offsets,
        from_cache=train.from_cache and val.from_cache,
        # The speed of whichever was tokenized in this run (None: both read from the cache).
        tokens_per_s=train.tokens_per_s if train.tokens_per_s is not None else val.tokens_per_s,
    )


def validation_source_name(data: DataConfig) -> str:
    """The validation source in words: ``--val-data val.jsonl``, ``--val-split test of --data
    hf:NAME``, or the held-out share of --data (``--val-fraction 0.05 of --data train.jsonl``)."""
    if data.val_data is not None:
        split = f" (split {data.val_split})" if data.val_split is not None else ""
        return f"--val-data {data.val_data}{split}"
    if data.val_split is not None:
        return f"--val-split {data.val_split} of --data {data.data}"
    return f"--val-fraction {data.val_fraction:g} of --data {data.data}"


def check_val_tokens(splits: TokenSplits, data: DataConfig, seq_len: int) -> None:
    """A validation source too short for one block of ``seq_len + 1`` tokens: a ConfigError naming
    it and its token count (the loader's own line speaks of the held-out share, --val-fraction)."""
    needed = seq_len + 1
    if data.validation_config() is None or len(splits.val) >= needed:
        return
    raise ConfigError(f"{validation_source_name(data)} has {len(splits.val):,} tokens, fewer than one validation "
                      f"block needs ({needed:,}: --seq-len {seq_len} + 1); give more validation text or lower --seq-len")


def same_source_warning(data: DataConfig) -> Optional[str]:
    """A warning line when the validation source is the training data itself (the same file by
    another spelling, the same hub split): its loss measures memorisation, not generalisation.
    None otherwise, and where a source cannot be resolved (reading it reports that)."""
    val_cfg = data.validation_config()
    if val_cfg is None:
        return None
    try:
        same = source_identity(val_cfg) == source_identity(data)
    except (ConfigError, OSError):
        return None
    if not same:
        return None
    return (f"warning: {validation_source_name(data)} is the training data (--data {data.data}): validation on "
            "text the model trains on measures memorisation; give a separate file or split")
