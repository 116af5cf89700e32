"""Tensors of a memory-mapped checkpoint, read off the mapping before anything touches them.

``torch.load(mmap=True)`` maps the whole file and hands out tensors that are slices of that
mapping: the optimizer's state, which export and generate never use, is then never read. But a
page of a mapping whose file was truncated meanwhile (someone rewrote or cut the checkpoint while
export read it) is not there any more, and the first touch of it ends the process with SIGBUS: no
line, no exit code the contract knows, an export's scratch folder left behind.

:func:`read_off_mapping` copies the tensors a reader needs (the model's) into private memory with
``pread`` on the file, at the offsets their mapping says, never touching the mapped pages: a file
cut before or during the copy is a short read, one ``error:`` line, and nothing touched afterwards
is mapped. Linux only (the offsets come from ``/proc/self/maps``); elsewhere, or for a tensor that
is no plain strided tensor of the mapping (torchao's NF4 weights keep inner tensors), the tensor
stays mapped as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from memtrain.config.run import ConfigError

MAPS = Path("/proc/self/maps")


class Region(NamedTuple):
    """One mapping of the checkpoint file: addresses [start, end) hold the file from ``offset``."""

    start: int
    end: int
    offset: int


def file_regions(st: os.stat_result) -> list[Region]:
    """The mappings of the file ``st`` describes in this process (empty where unknown)."""
    try:
        lines = MAPS.read_text().splitlines()
    except OSError:  # not Linux, or /proc not mounted
        return []
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    regions = []
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 5 or parts[4] != str(st.st_ino) or parts[3] != device:
            continue
        start, _, end = parts[0].partition("-")
        regions.append(Region(int(start, 16), int(end, 16), int(parts[2], 16)))
    return regions


def _file_offset(ptr: int, nbytes: int, regions: list[Region]) -> Optional[int]:
    for r in regions:
        if r.start <= ptr and ptr + nbytes <= r.end:
            return ptr - r.start + r.offset
    return None


def _pread_exactly(fd: int, nbytes: int, offset: int, path: Path) -> bytearray:
    """``nbytes`` from ``offset``; a file now shorter than that is a ConfigError."""
    buf = bytearray(nbytes)
    view, done = memoryview(buf), 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ConfigError(f"checkpoint {str(path)!r} was cut short while it was read ({offset + done} bytes "
                              f"of the {offset + nbytes} it needs); make sure nothing writes it, then run again")
        done += n
    return buf


def read_off_mapping(tensors: dict[str, Any], path: Path) -> dict[str, Any]:
    """``tensors`` (values of a ``torch.load(path, mmap=True)``) with every plain tensor mapped
    from ``path`` replaced by a private copy read with ``pread`` (views of one storage, such as
    tied weights, still share one copy). A file cut short is one ConfigError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read checkpoint {str(path)!r} ({exc.strerror}); check it is still there") from None
    try:
        regions = file_regions(os.fstat(fd))
        if not regions:
            return tensors
        copies: dict[int, torch.UntypedStorage] = {}
        out = {}
        for name, value in tensors.items():
            out[name] = value
            if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter:
                continue  # a tensor subclass (NF4) or no tensor: left as it is
            storage = value.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0:
                continue
            if ptr not in copies:
                offset = _file_offset(ptr, nbytes, regions)
                if offset is None:
                    continue  # not of this file's mapping: nothing to fear from its truncation
                data = _pread_exactly(fd, nbytes, offset, path)
                copies[ptr] = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
            copy = torch.empty(0, dtype=value.dtype)
            copy.set_(copies[ptr], value.storage_offset(), value.size(), value.stride())
            out[name] = copy
        return out
    finally:
        os.close(fd)
