"""The step loop's batches, the next one prepared while the current step runs.

On a GPU a compiled step of a small model takes a few milliseconds, and the loader's own work
between two steps (slicing token blocks, collating, pinning) was a tenth of it: the GPU idled
while the host fetched. :class:`DeviceFeed` fetches the next group of micro-batches on a
background thread while the main thread launches the current step and waits for it (CUDA
calls release the GIL), into pinned host memory, and copies each group to the device with
``non_blocking=True`` when it is handed out, so the copy overlaps the previous step's tail.

On a CPU the feed fetches on demand, in the caller's thread (there is no device copy to hide,
and a second thread would take a core from the step). ``ahead=True`` runs the background
mechanism on any device; tests use it to prove that the batches and the resume position are
exactly those of the plain loader.

A background thread rather than DataLoader worker processes: the loader's work is a few
array slices (no decoding), and workers would restart, and re-fork, at every resume.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from memtrain.data.loader import Batch, TrainLoader

__all__ = ["DeviceFeed"]


class DeviceFeed:
    """Groups of ``group`` micro-batches from ``loader``, on ``device``, one group ahead.

    :meth:`state_dict` is the position after the groups handed out so far, not after the one
    fetched ahead, so a checkpoint resumes with exactly the batch an uninterrupted run would
    take next (the contract of :class:`TrainLoader`).
    """

    def __init__(self, loader: TrainLoader, device: torch.device, ahead: Optional[bool] = None) -> None:
        self.loader = loader
        self.device = device
        self.ahead = device.type == "cuda" if ahead is None else ahead
        self._pin = device.type == "cuda"
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future[list[Batch]]] = None
        self._pending_size = 0
        self._position = loader.state_dict()  # after the groups handed out

    @property
    def batches_per_epoch(self) -> int:
        return self.loader.batches_per_epoch

    def _fetch(self, group: int) -> list[Batch]:
        """``group`` host batches, pinned where they will be copied to a GPU."""
        out = []
        for _ in range(group):
            x, y = self.loader.next_batch()
            if self._pin:
                x, y = x.pin_memory(), y.pin_memory()
            out.append((x, y))
        return out

    def _start_fetch(self, group: int) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memtrain-feed")
        self._position = self.loader.state_dict()  # no fetch runs now: the loader is at rest
        self._pending = self._executor.submit(self._fetch, group)
        self._pending_size = group

    def next_group(self, group: int) -> list[Batch]:
        """The next ``group`` micro-batches, on the device (their copies may still be in flight
        on the current stream, which orders them before any kernel that reads them)."""
        if not self.ahead:
            batches = self._fetch(group)
            self._position = self.loader.state_dict()
        else:
            if self._pending is None or self._pending_size != group:
                self._drop_pending()
                self._start_fetch(group)
            assert self._pending is not None
            batches = self._pending.result()
            self._start_fetch(group)  # the next group, while the caller runs this one
        return [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)) for x, y in batches]

    def _drop_pending(self) -> None:
        """Forget the group fetched ahead and put the loader back where the caller stands."""
        if self._pending is not None:
            self._pending.result()  # let the fetch finish before the loader is moved
            self._pending = None
            self.loader.load_state_dict(self._position)

    def state_dict(self) -> dict[str, int]:
        """Position after the batches handed out (see the class docstring)."""
        return dict(self._position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`; a group fetched ahead is dropped."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        self.loader.load_state_dict(state)
        self._position = self.loader.state_dict()

    def close(self) -> None:
        """Stop the background thread (a later group restarts it) and the loader's workers."""
        self._drop_pending()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.loader.close()
