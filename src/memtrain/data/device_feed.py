"""The step loop's batches, the next group fetched while the device runs the current step.

On a GPU a compiled step of a small model takes a few milliseconds, and the loader's own work
between two steps (slicing token blocks, collating, pinning) was a tenth of it: the GPU idled
while the host fetched. :class:`DeviceFeed` moves that work into the time the host would spend
waiting anyway: once a step's kernels are queued, and before the host waits for its loss, the
step harness calls :meth:`DeviceFeed.prefetch` (``train_step``'s ``before_wait``), which fetches
the next group into pinned host memory. :meth:`DeviceFeed.next_group` then hands it out and
copies it to the device with ``non_blocking=True``. The fetch costs the step nothing while the
device still has queued work to run; only when the host, not the device, is the bottleneck does
it show, in the step's time.

The fetch runs in the caller's thread on purpose. A background thread (the first design)
competes with the training thread for the interpreter lock, which every torch call releases and
takes back, so its Python work can land in the middle of the step's kernel launches; with it,
the compiled seed step on an H100 still waited 8.3-8.7% of its time for data. Here the fetch is
placed where the host has nothing else to do. DataLoader worker processes are no better for a
few array slices with no decoding, and they would restart, and re-fork, at every resume.

On a CPU there is no queued device work to hide behind (an operator returns when it is done),
so the feed fetches on demand, as the plain loader does. ``ahead=True`` runs the prefetching on
any device; tests use it to prove that the batches and the resume position are exactly those of
the plain loader.
"""

from __future__ import annotations

from typing import Optional

import torch

from memtrain.data.loader import Batch, MicroBatches, TrainLoader, host_target_count

__all__ = ["DeviceFeed"]


class DeviceFeed:
    """Groups of micro-batches from ``loader`` on ``device``, the next one fetched by
    :meth:`prefetch` while a step runs.

    :meth:`state_dict` is the position after the groups handed out so far, not after the one
    fetched ahead, so a checkpoint resumes with exactly the batch an uninterrupted run would
    take next (the contract of :class:`TrainLoader`).
    """

    def __init__(self, loader: TrainLoader, device: torch.device, ahead: Optional[bool] = None) -> None:
        self.loader = loader
        self.device = device
        self.ahead = device.type == "cuda" if ahead is None else ahead
        self._pin = device.type == "cuda"
        self._ready: Optional[list[Batch]] = None  # the group fetched ahead, on the host
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

    def prefetch(self, group: int) -> None:
        """Fetch the next ``group`` micro-batches now, to be handed out by the next
        :meth:`next_group` of the same size; nothing when not ``ahead`` or already fetched."""
        if self.ahead and self._ready is None:
            self._ready = self._fetch(group)

    def next_group(self, group: int) -> MicroBatches:
        """The next ``group`` micro-batches, on the device (their copies may still be in flight
        on the current stream, which orders them before any kernel that reads them). Under a
        target mask (--loss-on completion) or padding (--packing pad) each one's answer-token count is taken here, from
        the host tensors, before the copy: the step weighs each micro-batch by it with no sync."""
        if self._ready is not None and len(self._ready) == group:
            batches, self._ready = self._ready, None
        else:
            self._drop_ready()
            batches = self._fetch(group)
        self._position = self.loader.state_dict()
        out = MicroBatches((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                           for x, y in batches)
        if self.loader.dataset.ignores_targets:  # --loss-on completion's prompts, --packing pad's pads
            out.target_counts = [host_target_count(y) for _, y in batches]
        return out

    def _drop_ready(self) -> None:
        """Forget the group fetched ahead and put the loader back where the caller stands."""
        if self._ready is not None:
            self._ready = None
            self.loader.load_state_dict(self._position)

    def state_dict(self) -> dict[str, int]:
        """Position after the batches handed out (see the class docstring)."""
        return dict(self._position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`; a group fetched ahead is dropped."""
        self._ready = None
        self.loader.load_state_dict(state)
        self._position = self.loader.state_dict()

    def close(self) -> None:
        """Drop a group fetched ahead and stop the loader's workers, if any."""
        self._drop_ready()
        self.loader.close()
