"""The error every memtrain layer raises for bad user input, and the one-line form every
``error:`` line takes (a leaf module: it imports nothing but the standard library).

The CLI turns a ConfigError into one ``error:`` line on stderr and exit code 2 (docs/architecture.md).
"""

from __future__ import annotations

import errno
import re
from typing import Optional

__all__ = ["ChatTemplateLimit", "ConfigError", "ConfigFieldWarning", "NoticeWarning", "denied_access", "first_line", "is_out_of_memory", "name_too_long", "one_line", "out_of_room",
           "require", "shortened", "typed_first_line"]


class ConfigError(ValueError):
    """Bad user input. The message is one line that names the problem and the fix."""


class ChatTemplateLimit(ValueError):
    """A model's chat template that ran past its time or rendered past its size bound
    (memtrain.models.tokenizer.bounded_chat_template); the message says which, as a phrase that
    follows "the chat template". Here, not beside the bound: the data pipeline names it without
    importing the model code. ``max_chars``: the size bound it passed (None: the time bound)."""

    def __init__(self, message: str, max_chars: Optional[int] = None) -> None:
        super().__init__(message)
        self.max_chars = max_chars


class NoticeWarning(UserWarning):
    """A warning memtrain gives the user about their run: shown as one ``warning:`` line
    (memtrain.runtime.notices.install_warning_format). Here, a leaf, so that a reader of model
    configs below the runtime layer can give one."""


class ConfigFieldWarning(NoticeWarning):
    """A transformers config.json field the model's family has no setting of: a likely
    misspelling (transformers keeps it and ignores it), or an attention field memtrain leaves out."""


def require(cond: bool, message: str) -> None:
    """A :class:`ConfigError` saying ``message`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(message)


# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators: anything a
# terminal would break the line at or interpret.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name when the message is empty: what a
    one-line ``error:`` says of a library's multi-line exception."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def typed_first_line(exc: BaseException) -> str:
    """``Type: first line`` of ``exc`` (nothing after the colon when its message is empty): how a
    failure that is not bad input is named in an ``error:`` line or a bench row's ``error``."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def one_line(text: str) -> str:
    """``text`` with every control character written as its Python escape (``\\n``, ``\\x1b``),
    so a message that echoes user text (a path, a --model spec) stays one line on the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation that did not fit: torch's ``OutOfMemoryError`` (CUDA), the
    CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory"), Python's
    MemoryError, or any error that says "out of memory"."""
    text = str(exc).lower()
    return (type(exc).__name__ == "OutOfMemoryError" or isinstance(exc, MemoryError)
            or "out of memory" in text or "can't allocate memory" in text)


# An OSError the user fixes by choosing another path or changing permissions (bad input: exit 2),
# not a failure of memtrain's own.
_DENIED = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
           errno.EROFS: "read-only file system"}


def shortened(path: str, keep: int = 120) -> str:
    """``path`` cut to its first and last characters when longer than ``keep``: a line that
    refuses a path for its length need not repeat thousands of characters of it."""
    return path if len(path) <= keep else f"{path[:keep // 2]}...{path[-keep // 2:]}"


def denied_access(exc: BaseException) -> Optional[str]:
    """The one-line reason (without ``error:``) when ``exc`` is a file the user may not read or
    write (permission denied, a read-only file system), else None."""
    if not isinstance(exc, OSError) or exc.errno not in _DENIED:
        return None
    where = f" on {str(exc.filename)!r}" if exc.filename else ""
    return (f"{_DENIED[exc.errno]}{where}; change its permissions or give memtrain another path "
            "(files written before are intact)")


def name_too_long(exc: BaseException) -> Optional[str]:
    """The one-line reason (without ``error:``) when ``exc`` is a path the file system refuses for
    its length (a name over 255 bytes, a path over 4,096), else None: the user's path to shorten."""
    if not isinstance(exc, OSError) or exc.errno != errno.ENAMETOOLONG:
        return None
    where = f" {shortened(str(exc.filename))!r}" if exc.filename else ""
    return (f"file name too long{where}: a name may have 255 bytes and a path 4,096 here; give memtrain a "
            "shorter path (files written before are intact)")


def out_of_room(exc: BaseException) -> Optional[str]:
    """The one-line reason (without ``error:``) when ``exc`` is a write that found no room: a full
    disk, a used-up quota, or a file past this process's size limit (``ulimit -f``, EFBIG: Python
    ignores SIGXFSZ, so the write fails instead of the process ending), else None. Each names the
    file and what to change; writes that failed leave what was there (memtrain writes beside and
    renames)."""
    if not isinstance(exc, OSError) or exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return f"disk full{where}; free space and run again (files written before are intact)"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded{where}; free space under your quota and run again (files written before are intact)"
    return (f"file too large{where}: it passed this shell's file size limit (`ulimit -f`); raise it "
            "(`ulimit -f unlimited`) or write elsewhere, and run again (files written before are intact)")
