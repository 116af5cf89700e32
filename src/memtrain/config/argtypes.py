"""argparse ``type=`` functions for command-only flags (config fields validate themselves).

A bad value becomes argparse's one-line ``error: argument --flag: ...`` and exit 2, so a
nonsense count or duration is refused before anything runs. Upper bounds come from
:mod:`memtrain.analysis.limits`, the same as the config fields' and the analytic commands'.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable

from memtrain.analysis.limits import MAX_BATCH, MAX_INT, MAX_RANKS, MAX_WIDTH, MAX_WORLD_SIZE, short_number
from memtrain.devices.gpu_kinds import named_gpu_key, unknown_gpu_line
from memtrain.files.guard import unknown_home


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects {what}, got {text!r}") from None


def int_in(low: int, high: int, what: str = "an integer") -> Callable[[str], int]:
    """A type for integers in [low, high]; its name shows in argparse's messages."""

    def parse(text: str) -> int:
        value = _int(text, what)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:,}, {high:,}], got {short_number(value) if value > 0 else text}")
        return value

    parse.__name__ = what
    return parse


def positive_int(text: str) -> int:
    """An integer >= 1 (that fits in 64 bits)."""
    value = _int(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INT:,} (64 bits), got {short_number(value)}")
    return value


# A batch size, a batch search's bound or its step (maxbatch, bench, plan).
batch_count = int_in(1, MAX_BATCH, "a batch size")
# Ranks or processes one command starts on this machine.
rank_count = int_in(1, MAX_RANKS, "a process count")
# Ranks of a whole (possibly multi-machine) job, for per-rank estimates.
world_size = int_in(1, MAX_WORLD_SIZE, "a rank count")
# Tokens: a generation's length, a top-k cut (a vocabulary is at most MAX_WIDTH).
token_count = int_in(1, MAX_WIDTH, "a token count")
# A sampling seed: torch's generators take 64 bits.
seed_value = int_in(0, 2**64 - 1, "a seed")


def positive_float(text: str) -> float:
    """A finite number > 0 (e.g. seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (e.g. a sampling temperature, where 0 means greedy)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


# The smallest sampling temperature above 0 (greedy): transformers divides the float32 logits by
# it, and a temperature that is 0 in float32 (1e-300) or so small that a logit's quotient passes
# float32's 3.4e38 made the probabilities NaN (torch's "probability tensor contains either inf,
# nan or element < 0", exit 1). At 1e-30 a logit up to 3.4e8 in size stays finite.
MIN_TEMPERATURE = 1e-30


def sampling_temperature(text: str) -> float:
    """A sampling temperature: 0 (greedy) or a finite number of at least MIN_TEMPERATURE."""
    value = non_negative_float(text)
    if 0 < value < MIN_TEMPERATURE:
        raise argparse.ArgumentTypeError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {text}: "
                                         "smaller, the logits divided by it overflow float32; give 0 for greedy")
    return value


def user_path(text: str) -> str:
    """A path argument with "~" as the home folder, as the shell would expand it unquoted: the
    checks and the writes then read one path (they once checked "~/x" and wrote "./~/x")."""
    why = unknown_home(text, "the path")
    if why is not None:
        raise argparse.ArgumentTypeError(why.removeprefix("the path "))
    return os.path.expanduser(text)


def utf8_text(text: str) -> str:
    """Text that is UTF-8: bytes the locale could not decode reach Python as lone surrogates,
    which a tokenizer refused deep inside (``TypeError: TextEncodeInput must be ...``, exit 1)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not UTF-8 text (bytes the locale could not decode); give UTF-8 text") from None
    return text


def gpu_name(budget_flag: str | None) -> Callable[[str], str]:
    """A type for ``--gpu NAME``: a GPU kind by the one rule every verb shares
    (:func:`memtrain.devices.gpu_kinds.named_gpu_key`), kept as given. The refusal lists the
    known names and, for a card not listed, what to give instead: ``budget_flag`` (its memory,
    with CUDA kernels) where the verb has a budget, else the closest kind."""

    def parse(text: str) -> str:
        if named_gpu_key(text) is None:
            instead = (f"drop --gpu and give --device-type cuda with {budget_flag} SIZE" if budget_flag
                       else "name the closest one")
            raise argparse.ArgumentTypeError(f"{unknown_gpu_line(text)}; for a card not listed, {instead}")
        return text

    parse.__name__ = "a GPU name"
    return parse
