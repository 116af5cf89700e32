"""The error every memtrain layer raises for bad user input (a leaf module: it imports nothing).

The CLI turns it into one ``error:`` line on stderr and exit code 2 (docs/architecture.md).
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """Bad user input. The message is one line that names the problem and the fix."""
