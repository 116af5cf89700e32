"""Activation offloading: ``--offload-activations``.

The tensors autograd saves in the forward pass (for the backward) are copied to host memory as
they are saved, so the device copy is freed as soon as the forward no longer reads it; the
backward brings each one back just before its op needs it, a few ahead of use.

How, on each device:

* CUDA: the copy goes to pinned host memory on a side stream (the compute stream does not wait
  for it; ``record_stream`` keeps the device block from being reused before the copy has read
  it). In the backward, unpacking tensor *i* starts the host-to-device copies of the next
  :data:`~memtrain.techniques.facts.OFFLOAD_PREFETCH` tensors the backward will need (the ones
  saved just before *i*, since the backward runs the forward in reverse) on the same side stream,
  and the compute stream waits on an event for the one it needs now.
* CPU (and fake tensors): the same code path without streams: the forward copies into a
  distinct host buffer and the backward copies back into a fresh tensor, so the tracked meter
  (:class:`memtrain.metrics.MemoryMeter`) sees the timeline a GPU would have: it counts the host
  copies in its ``offloaded`` ledger (:func:`copying_to_host` tells it which allocations are
  host copies) and the copies brought back as backward temporaries.

What stays on the device, as in torchtune: parameters and views of parameters (and buffers),
because they stay resident anyway (the optimizer needs them), so a copy would free nothing and
cost link time each step; tensors under :data:`~memtrain.techniques.facts.OFFLOAD_MIN_BYTES`,
whose copy's fixed cost outweighs the bytes it would free; and tensor subclasses (NF4, DTensor
wrappers), whose layout a plain copy would not keep.

With ``--checkpointing``, the checkpointed blocks save only their inputs through these hooks
(non-reentrant ``torch.utils.checkpoint`` saves its inputs as ordinary saved tensors; the
block's internals go to its own hooks and are recomputed), so only those inputs move.

Why hand-written: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` copies every saved
tensor, parameters included, and brings each back only when it is unpacked (no prefetch, no
side stream); torchtune's ``OffloadActivations`` does the side stream but needs CUDA (it asks
for CUDA streams when built) and is not a dependency of memtrain. Both are built on torch's
documented ``torch.autograd.graph.saved_tensors_hooks``, as this is.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from memtrain.config.run import RunConfig
from memtrain.techniques.facts import OFFLOAD_MIN_BYTES, OFFLOAD_PREFETCH

__all__ = ["ActivationOffloader", "OffloadCounts", "copying_to_host", "offloader_for"]

_HOST_COPY = threading.local()


def copying_to_host() -> bool:
    """Whether this thread is allocating an offloaded host copy right now (the meter asks,
    so that it books the copy as offloaded host bytes, not as a device activation)."""
    return getattr(_HOST_COPY, "depth", 0) > 0


class _HostCopy:
    """While entered, :func:`copying_to_host` is True on this thread."""

    def __enter__(self) -> None:
        _HOST_COPY.depth = getattr(_HOST_COPY, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _HOST_COPY.depth -= 1


@dataclass
class OffloadCounts:
    """What the offloader moved since the last :meth:`ActivationOffloader.reset_counts`."""

    tensors: int = 0  # saved tensors copied to the host
    d2h_bytes: int = 0  # bytes copied device -> host (forward)
    h2d_bytes: int = 0  # bytes copied host -> device (backward)
    kept_small: int = 0  # saved tensors left on the device: under OFFLOAD_MIN_BYTES
    kept_parameters: int = 0  # saved tensors left on the device: parameters, buffers or views of them

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class _Handle:
    """One host copy: the tensor or storage copied, and its device copy once brought back
    (until the last saved variable that reads it has taken it)."""

    __slots__ = ("host", "index", "nbytes", "on_device", "event", "waiting", "__weakref__")

    def __init__(self, host: torch.Tensor, index: int, nbytes: int) -> None:
        self.host = host
        self.index = index
        self.nbytes = nbytes
        self.on_device: Optional[torch.Tensor] = None
        self.event: Any = None
        self.waiting = 1  # saved variables that will still unpack it (a storage saved by two ops: 2)

    @property
    def used(self) -> bool:
        return self.waiting <= 0


class _View:
    """What autograd keeps for one offloaded saved tensor: the copy it lives in and, when the
    copy is its whole storage, where in it (shape, strides, offset)."""

    __slots__ = ("handle", "shape", "stride", "offset")

    def __init__(self, handle: _Handle, shape: Optional[tuple], stride: Optional[tuple], offset: int) -> None:
        self.handle, self.shape, self.stride, self.offset = handle, shape, stride, offset


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake  # torch's own test; imported where used (rarely)

    return bool(is_fake(t))


class ActivationOffloader:
    """Saved-tensor hooks that offload one run's activations (see the module docstring).

    ``forward()`` is the context one forward pass runs under; the backward of that forward
    needs no context (the hooks travel with the saved tensors). ``counts`` says what moved.
    """

    def __init__(self, model: nn.Module, device: torch.device, min_bytes: int = OFFLOAD_MIN_BYTES,
                 prefetch: int = OFFLOAD_PREFETCH) -> None:
        self.model = model
        self.device = device
        self.min_bytes = min_bytes
        self.prefetch = prefetch
        self.counts = OffloadCounts()
        # Streams and pinned memory only on a real GPU (a fake CUDA trace has neither).
        self.streams = device.type == "cuda" and torch.cuda.is_available()
        self._side: Any = torch.cuda.Stream(device) if self.streams else None
        self._packed: list[weakref.ref] = []
        # One copy per storage (or per small view) however many ops save it (log-probabilities
        # by log_softmax and the loss): key (see _pack) -> (the storage, its copy's handle).
        self._seen: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}
        self._resident: set[int] = set()
        self._callback_queued = False

    # ------------------------------------------------------------------ public
    def forward(self) -> saved_tensors_hooks:
        """The context of one forward pass: every tensor it saves goes through :meth:`_pack`."""
        self._packed = []
        self._seen = {}
        self._callback_queued = False
        # Storages of parameters and buffers, read again each forward (FSDP2 and LoRA change them).
        self._resident = {id(t.untyped_storage()) for t in self._resident_tensors()}
        return saved_tensors_hooks(self._pack, self._unpack)

    def reset_counts(self) -> None:
        self.counts = OffloadCounts()

    # ------------------------------------------------------------------ forward: pack
    def _resident_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        yield from self.model.buffers()

    def _stays(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stays on the device (counted in ``counts`` when it does)."""
        if type(t) not in (torch.Tensor, nn.Parameter) and not _is_fake(t):
            return True  # a wrapper subclass (NF4, DTensor): a plain copy would lose its layout
        if t.layout != torch.strided or t.device.type != self.device.type:
            return True  # sparse, or already off the device (a CPU scalar on a CUDA run)
        base = t._base if t._base is not None else t
        if isinstance(base, nn.Parameter) or id(t.untyped_storage()) in self._resident:
            self.counts.kept_parameters += 1
            return True
        if t.numel() * t.element_size() < self.min_bytes:
            self.counts.kept_small += 1
            return True
        return False

    def _pack(self, t: torch.Tensor) -> Any:
        if self._stays(t):
            return t
        st = t.untyped_storage()
        esize = t.element_size()
        # A view that spans most of its storage (a reshaped or transposed activation, the
        # softmax output and the 3-D view the next matmul saves) is copied as its whole storage,
        # once for every view of it; a small view of a large storage only as itself.
        whole = st.nbytes() % esize == 0 and st.nbytes() <= 2 * t.numel() * esize
        key = (id(st), t.dtype) if whole else (id(st), t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        earlier = self._seen.get(key)
        handle = earlier[1]() if earlier is not None and earlier[0]() is st else None
        if handle is None:
            with torch.no_grad():
                source = t.detach()
                if whole:  # the storage as one flat tensor of t's dtype
                    source = source.as_strided((st.nbytes() // esize,), (1,), 0)
                handle = self._copy_out(source)
            self._seen[key] = (weakref.ref(st), weakref.ref(handle))
        else:
            handle.waiting += 1
        if whole:
            return _View(handle, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))
        return _View(handle, None, None, 0)

    def _copy_out(self, source: torch.Tensor) -> _Handle:
        """Copy ``source`` to host memory (pinned, on the side stream, on CUDA); its handle."""
        nbytes = source.numel() * source.element_size()
        with _HostCopy():
            host = torch.empty_like(source, device="cpu", pin_memory=self.streams)
            if self.streams:
                side = self._side
                side.wait_stream(torch.cuda.current_stream(source.device))  # source is fully written
                with torch.cuda.stream(side):
                    host.copy_(source, non_blocking=True)
                source.record_stream(side)  # its block is not reused until the copy has read it
            else:
                host.copy_(source)
        handle = _Handle(host, len(self._packed), nbytes)
        self._packed.append(weakref.ref(handle))
        self.counts.tensors += 1
        self.counts.d2h_bytes += nbytes
        return handle

    # ------------------------------------------------------------------ backward: unpack
    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _View):
            return packed  # a tensor that stayed on the device
        if not self._callback_queued and torch._C._current_graph_task_id() != -1:
            # At the end of this backward: the compute stream catches up with the side stream.
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            self._callback_queued = True
        h = packed.handle
        if h.on_device is None:
            self._bring_back(h)
        out = h.on_device
        assert out is not None
        h.waiting -= 1
        if h.used:  # the last saved variable of this copy has it: the handle lets go
            h.on_device = None
        if self.streams:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(h.event)
            out.record_stream(current)  # made on the side stream, used and freed on this one
        self._prefetch_before(h.index)
        if packed.shape is None or packed.stride is None:
            return out
        return out.as_strided(packed.shape, packed.stride, packed.offset)

    def _bring_back(self, h: _Handle) -> None:
        """Start the host -> device copy of ``h`` (on the side stream on CUDA)."""
        if self.streams:
            with torch.cuda.stream(self._side):
                h.on_device = h.host.to(self.device, non_blocking=True)
                h.event = self._side.record_event()
        else:
            # A distinct buffer, as on a GPU: the meter sees the device copy the backward holds.
            h.on_device = h.host.to(self.device, copy=True)
        self.counts.h2d_bytes += h.nbytes

    def _prefetch_before(self, index: int) -> None:
        """Bring back the ``prefetch`` live tensors saved just before ``index`` (the ones the
        backward needs next), unless they are on their way already."""
        ahead, j = 0, index - 1
        while j >= 0 and ahead < self.prefetch:
            h = self._packed[j]()
            if h is not None and not h.used:
                if h.on_device is None:
                    self._bring_back(h)
                ahead += 1
            j -= 1

    def _backward_done(self) -> None:
        if self.streams:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._callback_queued = False


def offloader_for(cfg: RunConfig, model: nn.Module, device: torch.device) -> Optional[ActivationOffloader]:
    """The run's offloader, or None when ``--offload-activations`` is off."""
    if not cfg.technique.offload_activations:
        return None
    return ActivationOffloader(model, device)
