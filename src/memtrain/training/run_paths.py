"""Where a saved run's relative paths point, from wherever it is resumed.

A run config records ``--out``, ``--save``, ``--data``, ``--val-data``, ``--chat-template`` and ``--model`` as they were typed, so a
relative one is relative to the folder the run was launched from. A checkpoint records that
folder (``cwd``); ``train --resume CKPT`` from another folder then continues in the run's own
``--out`` and ``--save`` and reads its own data, instead of starting a second copy of the run
beside the new working folder and refusing the data path as another run's.

Checkpoints written before they recorded ``cwd`` are placed by their ``--save``: a relative
``--save`` that the checkpoint's own path ends with gives the folder it was relative to.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any, Optional

# The run settings that name files or folders, by config section.
PATH_SETTINGS: dict[str, tuple[str, ...]] = {"train": ("out", "save"), "data": ("data", "chat_template", "val_data"),
                                             "model": ("model",)}
# Settings that may also hold a name that is no path ("default", "hf:ORG/NAME", a bundled model):
# taken as a path only where one exists.
MAYBE_NAMES = frozenset({"data", "val_data", "model"})


def launch_dir(state: dict[str, Any], checkpoint: str | Path) -> Optional[str]:
    """The folder the relative paths of a checkpoint's config are relative to: the ``cwd`` it
    records while that folder exists, else the one its own relative ``--save`` implies, else the
    recorded one (None where neither is known). A run's folder moved or renamed with its
    checkpoint (``mv proj proj2``) no longer exists: its paths were anchored there, so export
    could not find a relative ``--model`` and a resume wrote a new ``--out`` at the old place."""
    recorded = state.get("cwd")
    recorded = recorded if isinstance(recorded, str) and os.path.isabs(recorded) else None
    if recorded is not None and os.path.isdir(recorded):
        return recorded
    return _save_implied_dir(state, checkpoint) or recorded


def _save_implied_dir(state: dict[str, Any], checkpoint: str | Path) -> Optional[str]:
    """The folder a checkpoint's relative ``--save`` was relative to, where the checkpoint's own
    path ends with it (None where it does not, or the ``--save`` is absolute)."""
    train = state.get("config", {}).get("train") if isinstance(state.get("config"), dict) else None
    save = train.get("save") if isinstance(train, dict) else None
    if not isinstance(save, str) or not save or os.path.isabs(save) or save.startswith("~"):
        return None
    here = os.path.abspath(os.path.expanduser(str(checkpoint)))
    tail = os.sep + os.path.normpath(save)
    return here[: -len(tail)] or os.sep if here.endswith(tail) else None


def anchored(config: dict[str, Any], cwd: Optional[str]) -> dict[str, Any]:
    """``config`` with its relative path settings made absolute against ``cwd`` (where the run
    that wrote it was launched), when that is not this process's working folder; a name that
    is no path there (the default corpus, a Hub name, a bundled model) is kept as it is."""
    if cwd is None or os.path.abspath(cwd) == os.getcwd():
        return config
    out = {section: dict(values) if isinstance(values, dict) else values for section, values in config.items()}
    for section, keys in PATH_SETTINGS.items():
        values = out.get(section)
        if not isinstance(values, dict):
            continue
        for key in keys:
            value = values.get(key)
            if not isinstance(value, str) or not value or os.path.isabs(value) or value.startswith("~"):
                continue
            there = os.path.normpath(os.path.join(cwd, value))
            if key in MAYBE_NAMES and not (os.path.exists(there) or (glob.has_magic(value) and glob.glob(there))):
                continue
            values[key] = there
    return out


def same_place(key: str, old: Any, new: Any) -> bool:
    """Whether two values of setting ``key`` name the same thing: equal, or (for ``--data`` and
    ``--model``) two spellings of one existing file or folder (``d.jsonl``, ``./d.jsonl``, its
    absolute path)."""
    if old == new:
        return True
    if key not in MAYBE_NAMES or not isinstance(old, str) or not isinstance(new, str):
        return False
    return same_file(old, new)


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` ("~" expanded) are one existing file or folder."""
    a, b = os.path.expanduser(str(a)), os.path.expanduser(str(b))
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False
