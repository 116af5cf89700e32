"""GPT-2 byte-pair encoding, built offline.

``tiktoken.get_encoding("gpt2")`` downloads the vocabulary on first use. OpenAI's two files
(``encoder.json`` and ``vocab.bpe``, MIT licensed: ``memtrain/data/gpt2/LICENSE``) ship as
package data of memtrain, so the encoding is built from those instead and works without a
network (and without a package that pulls Python-2 compatibility shims). The files are checked
against the SHA-256 hashes tiktoken pins for GPT-2, so a changed file cannot silently give
different token ids.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

TOKENIZER_NAME = "gpt2"
N_VOCAB = 50257
EOT_ID = 50256
EOT_TEXT = "<|endoftext|>"

# GPT-2's pre-tokenization pattern (tiktoken's r50k_pat_str): contractions, letter runs,
# number runs, punctuation runs, whitespace.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# The hashes tiktoken pins for the published GPT-2 files.
_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def vocab_dir() -> Path:
    """The folder holding GPT-2's ``encoder.json`` and ``vocab.bpe`` (package data)."""
    return Path(str(resources.files("memtrain.data") / "gpt2"))


@functools.lru_cache(maxsize=1)
def get_tokenizer() -> tiktoken.Encoding:
    """The GPT-2 BPE encoding (50257 tokens, ``<|endoftext|>`` = 50256), built once per process."""
    data = vocab_dir()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"),
        encoder_json_file=str(data / "encoder.json"),
        vocab_bpe_hash=_VOCAB_BPE_SHA256,
        encoder_json_hash=_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name=TOKENIZER_NAME,
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={EOT_TEXT: EOT_ID},
        explicit_n_vocab=N_VOCAB,  # tiktoken checks the ranks and special tokens add up to it
    )


# Longest text handed to one encode call. tiktoken's working memory is ~40x the text it
# encodes at once (a 200 MB document peaked near 8 GB); longer documents are encoded in pieces.
ENCODE_PIECE_CHARS = 1 << 18


def encoding_pieces(text: str, limit: int = ENCODE_PIECE_CHARS) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``limit`` characters whose encodings, joined,
    equal the encoding of the whole text.

    A piece ends before a single space that follows a non-space and precedes one (``a| b``).
    GPT-2's pre-tokenizer (GPT2_PAT_STR) lets a space only begin a pre-token, never follow a
    non-space inside one, and byte-pair merges never cross pre-tokens: the whole text is split
    at that exact spot too, so the tokens are the same. Text with no such space in the last
    half of a window (a run of 128K characters without a word break) is cut at the limit; only
    the tokens at that cut can differ. Other tokenizers with a GPT-2-style pre-tokenizer
    (Llama 3, Qwen) split the same way; a SentencePiece one may differ by a token per cut.
    """
    start, n = 0, len(text)
    while n - start > limit:
        end = cut_before_word(text, start + limit // 2, start + limit) or start + limit
        yield text[start:end]
        start = end
    yield text[start:]


def cut_before_word(text: str, lo: int, hi: int) -> int | None:
    """The last index in (lo, hi] holding a space between two non-spaces, or None."""
    i = text.rfind(" ", lo, hi + 1)
    while i > lo:
        if not text[i - 1].isspace() and i + 1 < len(text) and not text[i + 1].isspace():
            return i
        i = text.rfind(" ", lo, i)
    return None


def encode_batch(texts: list[str], num_threads: int | None = None) -> list[list[int]]:
    """Encode documents in parallel, treating special-token text as ordinary text.

    ``encode_ordinary`` matters for scraped text: a post that literally contains
    ``<|endoftext|>`` must not inject a document boundary.
    """
    threads = num_threads or default_threads()
    return get_tokenizer().encode_ordinary_batch(texts, num_threads=threads)


def default_threads() -> int:
    """Encoding threads: tiktoken releases the GIL, but more than 8 threads rarely helps."""
    return max(1, min(8, os.cpu_count() or 1))
