"""Warnings memtrain itself raises, how the CLI shows them, and when a progress bar may share
stderr with them (no torch import here, so the CLI can install the format before a command
loads anything heavy, and the torch-free plan can ask about its bar)."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional

# Defined in memtrain.errors (a leaf): models.auto_config warns with ConfigFieldWarning, and this
# module's random_base_warning reads models.spec, so a home here would close an import circle.
from memtrain.errors import ConfigFieldWarning, NoticeWarning

__all__ = ["ConfigFieldWarning", "NoticeWarning", "PartOfARecordWarning", "QLoRASkipWarning", "SlowPrecisionWarning", "install_warning_format", "random_base_warning",
           "shows_progress"]


def shows_progress(requested: Optional[bool] = None) -> bool:
    """Whether a progress bar is drawn on stderr: ``requested`` (--progress / --no-progress)
    decides when given; unset (None), only when stderr is a terminal. A bar redraws its line
    with carriage returns: in a log or a captured stderr they stay, before an ``error:`` line
    or on it, so the refusal is no longer the one line a script reads."""
    if requested is not None:
        return requested
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # no stderr (None under pythonw), or a closed one
        return False


class SlowPrecisionWarning(NoticeWarning):
    """The run's precision has no native kernel on this device (slow matmuls)."""


class PartOfARecordWarning(NoticeWarning):
    """--text-field names one part of an instruction record (its prompt): the rest is not trained on."""


class QLoRASkipWarning(NoticeWarning):
    """--qlora leaves some frozen weights unquantized (their size does not fit NF4's blocks)."""


def install_warning_format() -> None:
    """Show a :class:`NoticeWarning` (memtrain's own, e.g. :class:`SlowPrecisionWarning`) on the
    terminal as one ``warning:`` line (the CLI's style) instead of Python's file:line form with
    the source line; other warnings keep their format."""
    original = warnings.formatwarning
    if getattr(original, "_memtrain", False):
        return

    def fmt(message: Any, category: type[Warning], filename: str, lineno: int, line: Optional[str] = None) -> str:
        if issubclass(category, NoticeWarning):
            return f"warning: {message}\n"
        return original(message, category, filename, lineno, line)

    fmt._memtrain = True  # type: ignore[attr-defined]
    warnings.formatwarning = fmt  # type: ignore[assignment]


def random_base_warning(cfg: Any) -> Optional[str]:
    """The warning for LoRA on randomly initialised base weights, or None.

    LoRA freezes the base and trains adapters on top of it: on a base nobody trained, the
    adapters learn around noise. A transformers --model without ``*.safetensors`` weights (a
    bundled config, a bare config.json) is built at random, and so is memtrain's GPT unless
    --resume loads trained weights. `memtrain train` says so once; the bench's LoRA row, which
    compares techniques on a GPT trained from scratch on purpose, does not call this.
    """
    tech, spec = cfg.technique, cfg.model.model
    if not tech.lora_rank or cfg.train.resume:
        return None
    from memtrain.models.source import resolve  # torch-free
    from memtrain.models.spec import is_gpt_preset  # torch-free

    if is_gpt_preset(spec):
        what = "memtrain's GPT starts from random weights (no --resume)"
    elif not resolve(spec).has_weights():
        what = f"--model {spec} has no *.safetensors weights, so its base is random"
    else:
        return None
    return (f"warning: --lora-rank {tech.lora_rank} on a random base: {what}; LoRA trains adapters on noise "
            "(drop --lora-rank to train every weight, or give a model with weights)")
