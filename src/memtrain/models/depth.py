"""Build a transformers model with fewer decoder layers than its config says (the seam the
depth-extrapolated trace, :mod:`memtrain.analysis.depth_trace`, builds its shallow probes with)."""


from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

__all__ = ["layer_count", "apply_layer_count"]

_LAYERS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("memtrain_hf_layers", default=None)


@contextlib.contextmanager
def layer_count(n: int) -> Iterator[None]:
    """Build transformers models with ``n`` decoder layers while inside (read by
    ``memtrain.models.hf.build_hf_model``); everything else about the config is unchanged."""
    token = _LAYERS.set(n)
    try:
        yield
    finally:
        _LAYERS.reset(token)


def apply_layer_count(config: Any) -> None:
    """Set ``config``'s depth to the :func:`layer_count` in force (no-op outside one)."""
    n = _LAYERS.get()
    if n is None:
        return
    config.num_hidden_layers = n
    types = getattr(config, "layer_types", None)
    if isinstance(types, list):
        config.layer_types = types[:n]


