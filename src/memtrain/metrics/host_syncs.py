"""Count the operations in a step that make the host wait for the device ("host syncs").

On a GPU the host queues kernels ahead of the device; an operation whose result the host must
read (``.item()``, ``bool(t)``, a data-dependent output shape such as ``nonzero``, a blocking copy
to the CPU) empties that queue, and the device idles while the host launches the next kernels.
One such read per layer, or per checkpointed recompute, costs a visible share of a step. This
meter finds them on any device, the CPU included: it counts the *operations* that would sync
on a GPU, whatever device runs them, and names where each was called from.

Hand-written because torch's own switch, ``torch.cuda.set_sync_debug_mode``, exists only on
CUDA and warns rather than counts. A ``TorchDispatchMode`` sees the ATen calls that reach the
dispatcher, which is where every such read ends up, and nothing compiled: torch.compile refuses
to trace under a non-infrastructure dispatch mode, so a compiled function (the bf16-pure
optimizer's update, a ``--compile`` model) is counted by running it eagerly or not at all. A
``.tolist()`` of a CPU tensor reads its memory without a dispatcher call, so it is not seen (on a GPU
tensor it is: the copy to the host is).

Usage::

    counter = HostSyncCounter()
    with counter:
        loss = model(x, y); loss.backward()
    counter.total, counter.describe()
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncCounter", "SYNCING_OPS"]

_aten = torch.ops.aten


def _overloads(*packets: Any) -> frozenset:
    return frozenset(getattr(p, name) for p in packets for name in p.overloads())


# Operations whose output the host needs before it can go on: a scalar read, an output whose
# shape depends on the values, a boolean answer. (repeat_interleave syncs only without output_size.)
SYNCING_OPS = _overloads(_aten._local_scalar_dense, _aten.nonzero, _aten.masked_select, _aten._unique,
                         _aten._unique2, _aten.unique_dim, _aten.unique_consecutive, _aten.equal)
_REPEAT_INTERLEAVE = _overloads(_aten.repeat_interleave)
_INDEXING = _overloads(_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_)
_COPIES = _overloads(_aten._to_copy, _aten.copy_)

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _syncs(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call makes the host wait for the device on a GPU."""
    if func in SYNCING_OPS:
        return True
    if func in _REPEAT_INTERLEAVE:
        # the output's length is the repeats' sum unless output_size (keyword-only) says it
        return func.__name__ in ("repeat_interleave.Tensor", "repeat_interleave.self_Tensor") and \
            kwargs.get("output_size") is None
    if func in _INDEXING:
        # a boolean mask as an index becomes nonzero() inside the kernel
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(_is_mask(i) for i in (indices or ()))
    if func in _COPIES:
        # a blocking copy from a device to the host (a non-blocking one into pinned memory does not wait)
        if func.__name__.startswith("copy_"):
            dst, src = args[0], args[1]
            return src.device.type not in ("cpu", "meta") and dst.device.type == "cpu" and not \
                (len(args) > 2 and args[2]) and not kwargs.get("non_blocking", False)
        to = kwargs.get("device")
        return to is not None and torch.device(to).type == "cpu" and args[0].device.type not in ("cpu", "meta") \
            and not kwargs.get("non_blocking", False)
    return False


def _call_site() -> str:
    """``file:line function`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(_TORCH_DIR) and name != _THIS_FILE:
            short = name.split("site-packages" + os.sep)[-1].split("src" + os.sep)[-1]
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
    return "unknown"


class HostSyncCounter(TorchDispatchMode):
    """A dispatch mode that counts host syncs by (operation, call site); re-enterable, so one
    counter can be entered around each phase of interest (forward, backward) and read once."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self.sites[(str(func.overloadpacket.__name__), _call_site())] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """Host syncs counted so far."""
        return sum(self.sites.values())

    def describe(self, top: int = 5) -> str:
        """One line: the count and the most frequent call sites ("none" when there were none)."""
        if not self.sites:
            return "none"
        parts = [f"{n}x {op} at {site}" for (op, site), n in self.sites.most_common(top)]
        more = len(self.sites) - top
        return f"{self.total}: " + "; ".join(parts) + (f"; and {more} more sites" if more > 0 else "")
