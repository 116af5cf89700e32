"""Warnings memtrain itself raises, and how the CLI shows them (no torch import here, so the
CLI can install the format before a command loads anything heavy)."""

from __future__ import annotations

import warnings
from typing import Any, Optional

__all__ = ["SlowPrecisionWarning", "install_warning_format"]


class SlowPrecisionWarning(UserWarning):
    """The run's precision has no native kernel on this device (slow matmuls)."""


def install_warning_format() -> None:
    """Show a :class:`SlowPrecisionWarning` on the terminal as one ``warning:`` line (the CLI's
    style) instead of Python's file:line form; other warnings keep their format."""
    original = warnings.formatwarning
    if getattr(original, "_memtrain", False):
        return

    def fmt(message: Any, category: type[Warning], filename: str, lineno: int, line: Optional[str] = None) -> str:
        if issubclass(category, SlowPrecisionWarning):
            return f"warning: {message}\n"
        return original(message, category, filename, lineno, line)

    fmt._memtrain = True  # type: ignore[attr-defined]
    warnings.formatwarning = fmt  # type: ignore[assignment]
