"""Bytes of the real storages behind tensors: each storage once, wrapper subclasses walked.

What :class:`memtrain.metrics.MemoryMeter` and the measured training state
(:mod:`memtrain.metrics.state`) count: a view shares its base's storage, a wrapper subclass
(DTensor, torchao low-bit state, float8, NF4) holds its bytes in inner tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["storage_bytes"]


@functools.lru_cache(maxsize=None)
def is_wrapper_type(cls: type) -> bool:
    """Whether ``cls`` is a traceable wrapper subclass: a tensor whose bytes live in inner
    tensors listed by ``__tensor_flatten__`` (DTensor, torchao low-bit state, float8, NF4)."""
    return (
        cls is not torch.Tensor
        and cls is not nn.Parameter
        and hasattr(cls, "__tensor_flatten__")
        and hasattr(cls, "__tensor_unflatten__")
    )


def leaf_storages(t: torch.Tensor) -> Iterator[tuple[torch.UntypedStorage, torch.device]]:
    """The real storages behind ``t`` with the device each belongs to.

    Wrapper subclasses hold no memory of their own, so their inner tensors are walked instead.
    The device reported is the tensor's, not the storage's, because a fake 'cuda' tensor has a
    'meta' storage.
    """
    stack = [t]
    while stack:
        x = stack.pop()
        if is_wrapper_type(type(x)):
            attrs, _ = x.__tensor_flatten__()  # type: ignore[attr-defined]  # wrapper subclasses define it (checked just above)
            stack.extend(v for v in (getattr(x, a) for a in attrs) if isinstance(v, torch.Tensor))
            continue
        try:
            st = x.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # sparse/nested layouts have no single storage; the meter cannot see them
        yield st, x.device


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """All tensors in an arbitrarily nested dict/list/tuple (optimizer state has any shape)."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)


def storage_bytes(obj: Any) -> int:
    """Bytes of the distinct real storages behind every tensor in ``obj`` (a tensor or nested
    dicts/lists/tuples, e.g. ``optimizer.state``), each storage counted once (views of one
    bucket share it). Wrapper subclasses count their inner tensors: a DTensor its local shard,
    torchao's low-bit state its codes, scales and quantization map."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors_in(obj):
        for st, device in leaf_storages(t):
            key = (str(device), st.data_ptr())
            if st.nbytes() and key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total
