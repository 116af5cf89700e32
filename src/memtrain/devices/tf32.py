"""TF32 for FP32 matmuls, whichever of torch's two switches was set first.

torch has two ways to say whether FP32 matmuls may round their inputs to TF32: the legacy ones
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``,
``torch.set_float32_matmul_precision``) and, from torch 2.9, ``fp32_precision`` attributes
(``torch.backends.fp32_precision``, ``torch.backends.cuda.matmul.fp32_precision``, ...). Once
the new ones have been set (transformers' ``TrainingArguments(tf32=...)`` sets
``torch.backends.fp32_precision`` on torch 2.9+), *reading* a legacy one raises a RuntimeError
("you have used mix of the legacy and new APIs") in torch 2.13; setting a legacy one never does,
and makes the legacy readers (inductor's ``torch.get_float32_matmul_precision()``) work again.

So memtrain reads the state through whichever API reads without raising, and sets it through
both: the new global first (else a ``tf32`` left there by another library keeps ruling the
backends memtrain does not name), then the legacy switches, which every reader then agrees with.

Inductor still reads the legacy API in torch 2.13: its autotuning cache keys on
``torch.get_float32_matmul_precision()`` (``PersistentCache.lookup`` and
``create_precompile_key`` in ``select_algorithm``), reached whenever a GEMM has more than one
candidate kernel: under max-autotune (ATen's and Triton's on CUDA; ATen's and the C++ template for
frozen weights on a CPU), not in the default or reduce-overhead modes, whose GEMMs have ATen's
alone. After another library set only the new API, :func:`align_legacy_with_new` makes the legacy
switches say the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["Fp32MatmulState", "align_legacy_with_new", "fp32_matmul_state", "fp32_only", "restore_fp32_matmul",
           "set_tf32"]


def _new_api_knobs() -> dict[str, tuple[Any, str]]:
    """The ``fp32_precision`` attributes this torch has (none before torch 2.9), by name."""
    b = torch.backends
    if not hasattr(b, "fp32_precision"):
        return {}
    # The global first: setting it rewrites the backends still at "none", so restoring it last
    # would undo what the backends' own values restore.
    candidates = {"global": b, "cuda.matmul": getattr(b.cuda, "matmul", None),
                  "cudnn.conv": getattr(b.cudnn, "conv", None), "cudnn.rnn": getattr(b.cudnn, "rnn", None),
                  "mkldnn.matmul": getattr(b.mkldnn, "matmul", None)}
    return {name: (obj, "fp32_precision") for name, obj in candidates.items()
            if obj is not None and hasattr(obj, "fp32_precision")}


@dataclass(frozen=True)
class Fp32MatmulState:
    """The FP32 matmul settings at one moment, as the API that could read them gives them.

    Attributes:
        legacy: ``(allow_tf32, float32 matmul precision)`` when the legacy API reads, else None.
        new: the ``fp32_precision`` values by knob name (empty on torch before 2.9).
    """

    legacy: tuple[bool, str] | None
    new: dict[str, str] = field(default_factory=dict)


def fp32_matmul_state() -> Fp32MatmulState:
    """The current FP32 matmul settings, read without raising whichever API set them."""
    new = {name: str(getattr(obj, attr)) for name, (obj, attr) in _new_api_knobs().items()}
    try:
        legacy: tuple[bool, str] | None = (bool(torch.backends.cuda.matmul.allow_tf32),
                                           torch.get_float32_matmul_precision())
    except RuntimeError:  # the new API was set last: the legacy readers refuse (torch 2.9+)
        legacy = None
    return Fp32MatmulState(legacy=legacy, new=new)


def restore_fp32_matmul(state: Fp32MatmulState) -> None:
    """Put back what :func:`fp32_matmul_state` read: through the new API where the legacy one
    could not read (so the state is again one the legacy readers refuse, as it was), else
    through the legacy one (so its readers work, as they did)."""
    for name, (obj, attr) in _new_api_knobs().items():
        if name in state.new:
            setattr(obj, attr, state.new[name])
    if state.legacy is not None:
        allow, precision = state.legacy
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.set_float32_matmul_precision(precision)


def set_tf32(enabled: bool) -> None:
    """TF32 on or off for FP32 matmuls and cuDNN, process-wide, through both APIs."""
    knobs = _new_api_knobs()
    if "global" in knobs:
        obj, attr = knobs["global"]
        setattr(obj, attr, "tf32" if enabled else "ieee")
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    torch.set_float32_matmul_precision("high" if enabled else "highest")


def align_legacy_with_new() -> None:
    """Make the legacy switches say what the new API says, where another library set only the
    new one (transformers' ``TrainingArguments(tf32=...)`` and its ``torch_compile=True`` do), so
    that inductor's legacy reads under max-autotune do not raise. TF32 stays as that library
    chose it (the CUDA matmul value rules); a no-op where the legacy readers already work."""
    if fp32_matmul_state().legacy is not None:
        return
    set_tf32(torch.backends.cuda.matmul.fp32_precision == "tf32")


@contextlib.contextmanager
def fp32_only() -> Iterator[None]:
    """Plain FP32 matmuls (no TF32) inside; the settings as they were afterwards."""
    state = fp32_matmul_state()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        restore_fp32_matmul(state)
