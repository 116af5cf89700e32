"""Steps' scalars (their losses, a gradient norm) read by the host without stalling the device.

Reading a CUDA tensor's value (``float(t)``, ``t.item()``) copies it to the host on the current
stream, and a stream runs its work in order: the read waits for every kernel queued before it.
Read right after a step, that is the step itself; the host then idles while the device finishes,
and the device idles while the host fetches the next batch, logs and launches the next step's
first kernels. On a compiled step of a few milliseconds those gaps are a large share.

:class:`StepReadings` stacks the scalars of one or more steps into one tensor, copies it into
pinned host memory with ``non_blocking=True`` and records an event right behind the copy. The
training loop (``memtrain.training.train``) keeps each step's loss on the device until a step
must be read (it writes a metrics line, evaluates, checkpoints, ends), so the steps between are
read together, once; and it queues step N+1 before it reads step N's values, waiting on that
event: it covers step N's work and nothing queued after it, so the device keeps step N+1 to run
while the host reads, logs and fetches. A plain ``float(loss)`` at that point would wait for
step N+1 as well.

torch offers the pieces (pinned memory, non-blocking copies, events) but no "read later"
object, so this small one is written here; CPU tensors, and runs that read at once, are read on
demand (one ``tolist`` of the stacked tensor; floats as they are).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, TypeGuard, Union

import torch

__all__ = ["StepReadings"]

Scalar = Union[torch.Tensor, float, None]


class StepReadings:
    """The losses of one or more consecutive steps and the last one's gradient norm (None when
    not wanted), read by the host together.

    With ``defer=True`` and CUDA tensors among them, they are stacked into one tensor on the
    device and copied to pinned host memory at once, without waiting, and one event marks the
    end of the copy; :meth:`losses` and :meth:`grad_norm` wait for that event only. Otherwise
    they are read on demand (a CPU tensor, or a run that reads at once), still as one tensor when
    they are tensors: one read per group of steps, not one per step.
    """

    def __init__(self, losses: Sequence[Union[torch.Tensor, float]], grad_norm: Scalar = None, *,
                 defer: bool = False) -> None:
        self._count = len(losses)
        self._values: Any = list(losses)
        self._grad_norm: Scalar = grad_norm
        self._copied: Optional[Any] = None  # the event behind the host copy, when one was made
        tensors = [v for v in (*losses, grad_norm) if isinstance(v, torch.Tensor)]
        if len(tensors) == self._count + (grad_norm is not None) and tensors:
            # One tensor: the losses, then the gradient norm (float32 holds both exactly as
            # float(t) would read them: a BF16 norm widens without rounding).
            self._values = torch.stack([t.detach().reshape(()).to(torch.float32) for t in tensors])
            self._grad_norm = None
            if defer and _on_cuda(self._values):
                self._values = _to_host(self._values)
                self._copied = torch.cuda.Event()
                # On the stream the copy was queued on (the tensors' device's current one), behind it.
                self._copied.record(torch.cuda.current_stream(tensors[0].device))
        self._read: Optional[list[float]] = None

    def losses(self) -> list[float]:
        """The steps' mean losses, oldest first, waiting only for the last of these steps."""
        return self._floats()[:self._count]

    def grad_norm(self) -> Optional[float]:
        """The last step's gradient norm (None when it was not asked for, or not clipped)."""
        values = self._floats()
        return values[self._count] if len(values) > self._count else None

    def _floats(self) -> list[float]:
        if self._read is None:
            if self._copied is not None:
                self._copied.synchronize()
            if isinstance(self._values, torch.Tensor):
                self._read = self._values.tolist()  # the one read of these steps
            else:
                self._read = [float(v) for v in self._values]
                if self._grad_norm is not None:
                    self._read.append(float(self._grad_norm))
        return self._read


def _on_cuda(value: Scalar) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _to_host(value: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a CUDA tensor, started without waiting."""
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value.detach(), non_blocking=True)
    return host
