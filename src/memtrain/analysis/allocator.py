"""What the GPU will say: PyTorch's CUDA caching allocator replayed over a tensor timeline.

The estimator's timeline (and MemoryMeter) count live tensor bytes. Users read something else:
``torch.cuda.max_memory_allocated`` (rounded blocks), ``max_memory_reserved`` (the segments the
allocator took from the driver and keeps cached) and ``nvidia-smi`` (reserved + the CUDA context
+ libraries' workspaces). This module is a model of ``c10/cuda/CUDACachingAllocator.cpp`` (torch
2.x, default settings, one stream, no ``expandable_segments``; its sizes are in
:mod:`memtrain.devices.gpu_kinds`), hand-written because torch has no CPU-side simulator of it:

* every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
* requests <= 1 MiB (``kSmallSize``) are served from the small pool, carved out of 2 MiB
  segments (``kSmallBuffer``); larger ones from the large pool, whose new segments are 20 MiB
  (``kLargeBuffer``) for requests < 10 MiB (``kMinLargeAlloc``) and the request rounded up to
  2 MiB (``kRoundLarge``) otherwise;
* a request takes the smallest cached free block of its pool that fits (best fit) and splits it
  when the remainder is >= 512 B (small pool) or > 1 MiB (large pool);
* a freed block is merged with free neighbours of its segment and stays cached: reserved memory
  never shrinks during a step (no ``empty_cache``, no OOM-retry, which would free the cache).

Device total = reserved + the CUDA context. cuBLAS's workspaces come from the caching allocator
in torch 2.x (so they are in ``allocated`` and ``reserved``): one per cuBLAS handle and stream,
and handles are per thread, so a training run has two, the main thread's (made by the first
forward matmul) and the autograd engine's backward thread's (made by the first backward
matmul; the ``"workspace"`` event of a timeline). The context is
outside torch and differs by GPU, driver and CUDA version: the table of GPU kinds
(:mod:`memtrain.devices.gpu_kinds`) holds the assumption per kind, stated wherever it is used.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Optional

from memtrain.devices.gpu_kinds import (
    LARGE_BUFFER,
    MIN_BLOCK,
    MIN_LARGE_ALLOC,
    ROUND_LARGE,
    SMALL_BUFFER,
    SMALL_SIZE,
    allocator_facts,
)

__all__ = [
    "CachingAllocator",
    "DeviceMemory",
    "replay",
    "round_size",
]

MiB = 1 << 20

# What a process holds on the device outside torch's cache (the CUDA context, as nvidia-smi
# shows it after a training step) and the cuBLAS workspace, per GPU kind: in the one table of
# GPU kinds (memtrain.devices.gpu_kinds.AllocatorFacts), which says which figures were measured.


def round_size(nbytes: float) -> int:
    """The block size the allocator hands out for a request of ``nbytes`` (512-byte multiples)."""
    n = int(-(-nbytes // 1)) if nbytes > 0 else 0
    return MIN_BLOCK if n < MIN_BLOCK else MIN_BLOCK * (-(-n // MIN_BLOCK))


def _segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * (-(-size // ROUND_LARGE))


@dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = False
    prev: Optional["_Block"] = field(default=None, repr=False)
    next: Optional["_Block"] = field(default=None, repr=False)

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocator:
    """The model: ``malloc(nbytes) -> handle``, ``free(handle)``; tracks allocated / reserved and
    their peaks, like ``torch.cuda.memory_stats``'s ``allocated_bytes`` / ``reserved_bytes``."""

    def __init__(self, max_split_size: Optional[int] = None) -> None:
        # PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb: large blocks of at least this size are
        # never split and serve only requests within kLargeBuffer (20 MiB) of their size.
        # None: torch's default (unlimited).
        self.max_split_size = max_split_size if max_split_size is not None else float("inf")
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> sorted keys
        self._by_key: dict[tuple[int, int, int], _Block] = {}
        self._live: dict[int, _Block] = {}
        self._segments: dict[int, bool] = {}  # segment id -> small pool?
        self._next_handle = 0
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments_created = 0

    def _add_free(self, block: _Block, small: bool) -> None:
        block.free = True
        bisect.insort(self._free[small], block.key())
        self._by_key[block.key()] = block

    def _remove_free(self, block: _Block, small: bool) -> None:
        pool = self._free[small]
        i = bisect.bisect_left(pool, block.key())
        assert pool[i] == block.key()
        pool.pop(i)
        del self._by_key[block.key()]
        block.free = False

    def malloc(self, nbytes: float) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1, -1))
        mss = self.max_split_size
        fits = i < len(pool)
        if fits and not small:
            # get_free_block: only the smallest fitting block is considered; an oversize one
            # (>= max_split_size) is refused to a normal request, and to an oversize request
            # when it is kLargeBuffer or more larger than it.
            found = pool[i][0]
            fits = not ((size < mss and found >= mss) or (size >= mss and found >= size + LARGE_BUFFER))
        if fits:
            block = self._by_key[pool[i]]
            self._remove_free(block, small)
        else:
            seg = self.segments_created
            self.segments_created += 1
            block = _Block(seg, 0, _segment_size(size))
            self._segments[seg] = small
            self.reserved += block.size
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and size < mss and remaining > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._add_free(rest, small)
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._next_handle += 1
        self._live[self._next_handle] = block
        return self._next_handle

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        small = self._segments[block.segment]
        self.allocated -= block.size
        # Merge with free neighbours of the same segment (the segment stays reserved).
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour, small)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        self._add_free(block, small)


@dataclass
class DeviceMemory:
    """What ``max_memory_allocated``, ``max_memory_reserved`` and nvidia-smi would report."""

    tracked_peak: float  # live tensor bytes (the timeline's peak)
    allocated: int  # peak of rounded blocks, cuBLAS workspace included
    reserved: int  # peak of cached segments
    device_total: int  # reserved + CUDA context
    cuda_context: int
    cublas_workspace: int  # bytes of one workspace (a run has one per thread that runs matmuls)
    gpu: str
    segments: int
    assumptions: list[str]
    # Reserved when the measured step starts (the first step's high-water mark; None when the
    # timeline has no step boundary).
    reserved_first_step: Optional[int] = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("tracked_peak", "allocated", "reserved", "device_total", "cuda_context",
                                              "cublas_workspace", "gpu", "segments", "assumptions",
                                              "reserved_first_step")}


def replay(events: Iterable[tuple[str, int, float]], gpu: Optional[str] = None, tracked_peak: float = 0.0,
           persistent_first: Iterable[float] = ()) -> DeviceMemory:
    """Replay a timeline through the allocator model.

    ``events``: ("alloc", id, nbytes) / ("free", id, 0) / ("reset_peak", 0, 0) / ("workspace", 0, 0) in
    order; ``persistent_first``: sizes of tensors allocated before the timeline starts and never
    freed (e.g. each parameter). The main thread's cuBLAS workspace is allocated first (the first
    matmul of the first step creates it); a ``"workspace"`` event allocates another, kept to the
    end (the backward thread's).
    """
    facts = allocator_facts(gpu)
    key = facts.label
    alloc = CachingAllocator()
    ws = facts.cublas_workspace_bytes
    for nbytes in persistent_first:
        if nbytes > 0:
            alloc.malloc(nbytes)
    alloc.malloc(ws)
    handles: dict[int, int] = {}
    first_step: Optional[int] = None
    workspaces = 1
    for op, sid, nbytes in events:
        if op == "workspace":
            alloc.malloc(ws)
            workspaces += 1
        elif op == "reset_peak":  # torch.cuda.reset_peak_memory_stats: allocated only (reserved keeps its segments)
            alloc.peak_allocated = alloc.allocated
            first_step = alloc.reserved
        elif op == "alloc":
            if nbytes > 0:
                handles[sid] = alloc.malloc(nbytes)
        elif sid in handles:
            alloc.free(handles.pop(sid))
    ctx = facts.cuda_context_bytes
    return DeviceMemory(
        tracked_peak=tracked_peak, allocated=alloc.peak_allocated, reserved=alloc.peak_reserved,
        device_total=alloc.peak_reserved + ctx, cuda_context=ctx, cublas_workspace=ws, gpu=key,
        segments=alloc.segments_created, reserved_first_step=first_step,
        assumptions=[f"CUDA context {ctx / MiB:.0f} MiB for GPU kind '{key}' (assumed: "
                     + (f"measured, {facts.context_source}; driver and CUDA version change it"
                        if facts.context_measured else "not measured; benchmarks/allocator_check.py measures it")
                     + ")",
                     f"{workspaces} cuBLAS workspace(s) of {ws / MiB:.2f} MiB through the caching allocator, one per "
                     "thread that runs matmuls (the forward's" + (", the backward's" if workspaces > 1 else "") + ")",
                     "caching allocator defaults: one stream, no expandable_segments, no empty_cache"],
    )
