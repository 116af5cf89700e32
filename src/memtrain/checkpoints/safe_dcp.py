"""Read torch.distributed.checkpoint (DCP) directories without executing anything they hold.

torch's own reader is not safe on a file from elsewhere: ``FileSystemReader.read_metadata``
unpickles ``.metadata`` with plain :mod:`pickle` (a crafted ``__reduce__`` runs any command),
and ``DefaultLoadPlanner.load_bytes`` reads every non-tensor item with
``torch.load(weights_only=False)``. torch offers no safe switch for either (2.13), so this
module hand-writes the two replacements:

- :class:`SafeFileSystemReader`: ``.metadata`` through :class:`_MetadataUnpickler`, whose
  ``find_class`` allows only the classes a DCP metadata file is made of (the dataclasses of
  ``torch.distributed.checkpoint.metadata``, ``torch.Size``, dtypes, layouts, a path);
  anything else raises :class:`UnsafeCheckpointError` before it is constructed.
- :class:`SafeLoadPlanner`: byte items through ``torch.load(weights_only=True)`` (numbers,
  strings, lists, dicts and tensors only). Tensor items are already read that way by torch.

:func:`read_metadata` lets every rank check a checkpoint before the collective load starts,
so a refused file fails every rank alike (no rank is left waiting in a collective).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from memtrain.files.guard import regular_file_problem

METADATA_FILE = ".metadata"

# (module, name) pairs found in the metadata torch 2.x writes; constructing any of them
# runs no user-chosen code (dataclasses, an Enum, torch.Size of a tuple, a layout lookup).
_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references something outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only allow-listed globals (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"{module}.{name} is not part of a DCP metadata file")


def load_metadata(stream: io.BufferedIOBase | Any) -> Metadata:
    """Unpickle a ``.metadata`` stream with the allow-list; check the result's type."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated, garbage, or a class whose construction failed
        raise UnsafeCheckpointError(f"unreadable metadata ({type(exc).__name__})") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"metadata is a {type(metadata).__name__}, not a DCP Metadata")
    return metadata


class UnsafeStorageError(UnsafeCheckpointError):
    """A file of a checkpoint, or one its metadata names, is not a regular file inside it."""


def _checked_file(checkpoint_dir: Path, relative: Any) -> Path:
    """``checkpoint_dir / relative`` when it names a regular file inside the checkpoint folder
    (a relative path without ``..``; a link only to a file inside); else UnsafeStorageError."""
    if isinstance(relative, PurePath):
        relative = str(relative)
    if not isinstance(relative, str) or not relative:
        raise UnsafeStorageError(f"its .metadata names a storage file by a {type(relative).__name__}, not a path")
    rel = PurePosixPath(relative)
    if rel.is_absolute() or ".." in rel.parts:
        raise UnsafeStorageError(f"its .metadata names storage file {relative!r}, outside the checkpoint folder")
    path = checkpoint_dir / rel
    why = regular_file_problem(path, checkpoint_dir)
    if why is not None:
        label = "its .metadata" if relative == METADATA_FILE else f"its storage file {relative!r}"
        raise UnsafeStorageError(f"{label} is {why}")
    return path


def check_storage(metadata: Metadata, checkpoint_dir: str | Path) -> None:
    """Every file the metadata's ``storage_data`` points the reader at is a regular file inside
    ``checkpoint_dir``, and every (offset, length) lies within it; else UnsafeStorageError.

    torch's reader opens ``folder / relative_path`` for whatever path the metadata holds (an
    absolute path or ``..`` reads outside the checkpoint; a FIFO blocks forever)."""
    root = Path(checkpoint_dir)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise UnsafeCheckpointError(f"its storage_data is a {type(storage).__name__}, not a mapping")
    sizes: dict[str, int] = {}
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        key = str(relative)
        if key not in sizes:
            sizes[key] = _checked_file(root, relative).stat().st_size
        offset: Any = getattr(info, "offset", None)
        length: Any = getattr(info, "length", None)
        if not (_whole(offset) and _whole(length)):
            raise UnsafeStorageError(f"its .metadata gives storage file {key!r} offset {offset!r} and length {length!r}")
        if offset + length > sizes[key]:
            raise UnsafeStorageError(f"its .metadata names bytes past the end of storage file {key!r} "
                                     f"({sizes[key]} bytes)")


def _whole(value: Any) -> bool:
    """A non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_metadata(checkpoint_dir: str | Path) -> Metadata:
    """The checkpoint's ``.metadata``, read safely, with every storage file it names checked
    (raises :class:`UnsafeCheckpointError`)."""
    root = Path(checkpoint_dir)
    with open(_checked_file(root, METADATA_FILE), "rb") as fh:
        metadata = load_metadata(fh)
    check_storage(metadata, root)
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-listed unpickler, and whose
    storage files are checked (regular files inside the checkpoint) before any is opened."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        _checked_file(Path(self.path), Path(path).name)
        with self.fs.create_stream(path, "rb") as fh:
            metadata = load_metadata(fh)
        check_storage(metadata, Path(self.path))
        # What torch's reader does after unpickling (kept in step with torch 2.13).
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # set just above when missing
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose byte items are loaded with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # The same body as torch's, but weights_only=True.
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
