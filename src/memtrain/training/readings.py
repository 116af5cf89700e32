"""A step's scalars (its loss, its gradient norm) read by the host without stalling the device.

Reading a CUDA tensor's value (``float(t)``, ``t.item()``) copies it to the host on the current
stream, and a stream runs its work in order: the read waits for every kernel queued before it.
Read right after a step, that is the step itself; the host then idles while the device finishes,
and the device idles while the host fetches the next batch, logs and launches the next step's
first kernels. On a compiled step of a few milliseconds those gaps are a large share.

:class:`StepReadings` copies the scalars into pinned host memory with ``non_blocking=True`` and
records an event right behind the copies. The training loop (``memtrain.training.train``)
queues step N+1 and only then reads step N's values, waiting on that event: it covers step N's
work and nothing queued after it, so the device keeps step N+1 to run while the host reads,
logs and fetches. A plain ``float(loss)`` at that point would wait for step N+1 as well.

torch offers the pieces (pinned memory, non-blocking copies, events) but no "read later"
object, so this small one is written here; CPU tensors, and runs that read at once, pass
through ``float`` unchanged.
"""

from __future__ import annotations

from typing import Any, Optional, TypeGuard, Union

import torch

__all__ = ["StepReadings"]

Scalar = Union[torch.Tensor, float, None]


class StepReadings:
    """One step's loss and gradient norm (None when not wanted), read as floats.

    With ``defer=True``, each 0-d CUDA tensor among them is copied to pinned host memory at
    once, without waiting, and one event marks the end of the copies; :meth:`loss` and
    :meth:`grad_norm` wait for that event only. Otherwise (``defer=False``, or no CUDA tensor)
    they are read on demand with ``float``, exactly as the caller would have read them.
    """

    def __init__(self, loss: Union[torch.Tensor, float], grad_norm: Scalar = None, *, defer: bool = False) -> None:
        self._loss: Union[torch.Tensor, float] = loss
        self._grad_norm: Scalar = grad_norm
        self._copied: Optional[Any] = None  # the event behind the host copies, when any were made
        on_cuda = [v for v in (loss, grad_norm) if _on_cuda(v)]
        if defer and on_cuda:
            self._loss = _to_host(loss)
            self._grad_norm = _to_host(grad_norm)
            self._copied = torch.cuda.Event()
            # On the stream the copies were queued on (the tensors' device's current one), behind them.
            self._copied.record(torch.cuda.current_stream(on_cuda[0].device))

    def loss(self) -> float:
        """The step's mean loss, waiting only for its own step."""
        self._wait()
        return float(self._loss)

    def grad_norm(self) -> Optional[float]:
        """The step's gradient norm (None when it was not asked for, or not clipped)."""
        self._wait()
        return None if self._grad_norm is None else float(self._grad_norm)

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()


def _on_cuda(value: Scalar) -> TypeGuard[torch.Tensor]:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _to_host(value: Any) -> Any:
    """A pinned host copy of a CUDA tensor, started without waiting; anything else as it is."""
    if not _on_cuda(value):
        return value
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value.detach(), non_blocking=True)
    return host
