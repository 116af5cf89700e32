"""Numeric precision: FP32, TF32 matmuls, BF16/FP16 autocast, pure BF16 weights.

``make_precision(precision, device)`` returns a :class:`Precision` that the train loop
uses without knowing which mode is on: ``autocast()`` around forward and loss, ``scaler``
(a GradScaler for FP16, else a pass-through), and ``param_dtype`` for the weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import ContextManager, Optional

import torch

from memtrain.config import ConfigError


@dataclass
class Precision:
    """How one run computes: autocast dtype, weight dtype, loss scaling."""

    name: str
    device_type: str
    autocast_dtype: Optional[torch.dtype] = None
    param_dtype: torch.dtype = torch.float32
    scaler: Optional[torch.amp.GradScaler] = None
    skipped_steps: int = field(default=0)

    def autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


def make_precision(precision: str, device: torch.device) -> Precision:
    """Validate ``precision`` for ``device`` and set global matmul precision (TF32)."""
    dt = device.type
    # TF32 is a global switch: set it explicitly every run so one row cannot leak into the next.
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    if precision in ("fp32", "tf32"):
        return Precision(precision, dt)
    if precision in ("bf16", "bf16-pure"):
        if dt == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError("--precision bf16 needs a GPU with bfloat16 (Ampere or newer); use --precision fp16")
        if precision == "bf16":
            return Precision(precision, dt, autocast_dtype=torch.bfloat16)
        return Precision(precision, dt, param_dtype=torch.bfloat16)
    if precision == "fp16":
        scaler = torch.amp.GradScaler(dt)
        return Precision(precision, dt, autocast_dtype=torch.float16, scaler=scaler)
    raise ConfigError(f"unknown --precision {precision!r}")
