"""Numeric precision: FP32, TF32 matmuls, BF16/FP16 autocast, pure BF16 weights.

``make_precision(precision, device)`` returns a :class:`Precision` that the train loop
uses without knowing which mode is on: ``autocast()`` around forward and loss, ``scaler``
(a GradScaler for FP16, else None), and ``param_dtype`` for the weights.

========== ============ ============= ==========================================================
mode       weights      matmuls       notes
========== ============ ============= ==========================================================
fp32       FP32         FP32          the reference
tf32       FP32         TF32 (CUDA)   10-bit mantissa inputs on Ampere+ tensor cores; on CPU,
                                      oneDNN uses TF32 only where the CPU has it, else FP32
bf16       FP32         BF16 autocast FP32 weights, gradients and optimizer state; activations
                                      saved for backward are BF16
fp16       FP32         FP16 autocast plus a GradScaler: FP16's 5-bit exponent underflows small
                                      gradients, so the loss is scaled up before backward and
                                      a step whose gradients overflowed is skipped (counted in
                                      ``skipped_steps``)
bf16-pure  BF16         BF16          no FP32 master copy: weights and gradients take half the
                                      bytes; the optimizer rounds its FP32 update into the BF16
                                      weight stochastically (torchao ``bf16_stochastic_round``,
                                      see :mod:`memtrain.techniques.optim`)
fp8        FP32         FP8 Linears   torchao float8 training under BF16 autocast: each block
                                      Linear casts input and weight to FP8 per matmul (CUDA,
                                      compute capability 8.9+; see :mod:`memtrain.techniques.fp8`)
========== ============ ============= ==========================================================
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import ContextManager, Optional

import torch

from memtrain.config.run import ConfigError
from memtrain.devices.tf32 import set_tf32
from memtrain.techniques.facts import PrecisionFacts, precision_facts
from memtrain.techniques.fp8 import check_fp8_device


@dataclass
class Precision:
    """How one run computes: autocast dtype, weight dtype, loss scaling."""

    name: str
    device_type: str
    autocast_dtype: Optional[torch.dtype] = None
    param_dtype: torch.dtype = torch.float32
    scaler: Optional[torch.amp.GradScaler] = None
    # The steps GradScaler skipped that have been read (see skipped_steps).
    _skipped_read: int = field(default=0, repr=False)
    # Those not read yet: a count on the device, added to at each step without waiting for it.
    _skipped_pending: Optional[torch.Tensor] = field(default=None, repr=False)
    # The last step's global gradient norm before clipping (a tensor: read it only when logging,
    # so the step does not wait on the device for it).
    last_grad_norm: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps GradScaler skipped (inf/NaN gradients); reading it waits for the device."""
        if self._skipped_pending is not None:
            self._skipped_read += int(self._skipped_pending)
            self._skipped_pending = None
        return self._skipped_read

    @skipped_steps.setter
    def skipped_steps(self, count: int) -> None:
        self._skipped_read, self._skipped_pending = count, None

    def count_skipped(self, skipped: torch.Tensor) -> None:
        """Add a step's skipped flag (a 0-d device tensor, bool or 0/1) to the count without
        reading it: a read here would make the host wait for every step's optimizer on a GPU.
        The count is a float32 tensor (exact to 2**24 steps) added to in place: one kernel a step."""
        if self._skipped_pending is None:
            self._skipped_pending = skipped.detach().to(torch.float32, copy=True)
        else:
            self._skipped_pending.add_(skipped)

    def autocast(self) -> ContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.autocast_dtype)


def _cpu_fp16_autocast_works() -> bool:
    """Whether this torch build runs CPU autocast in FP16 (older builds silently fall back)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an unsupported dtype warns, then autocast is off
            with torch.autocast("cpu", dtype=torch.float16):
                out = torch.ones(2, 2) @ torch.ones(2, 2)
            torch.amp.GradScaler("cpu")
    except (RuntimeError, ValueError, AssertionError):
        return False
    return out.dtype == torch.float16


def torch_dtypes(facts: PrecisionFacts) -> tuple[torch.dtype, Optional[torch.dtype]]:
    """The weight dtype and the autocast dtype (None: no autocast) of a precision's facts."""
    autocast = getattr(torch, facts.autocast_dtype) if facts.autocast_dtype is not None else None
    return getattr(torch, facts.param_dtype), autocast


def precision_for_count(name: str, device_type: str = "cpu") -> Precision:
    """``name``'s dtypes without make_precision's process-wide TF32 switch or a loss scaler:
    for counting FLOPs, which must not change the settings of a run in the same process."""
    param, autocast = torch_dtypes(precision_facts(name))
    return Precision(name, device_type, autocast_dtype=autocast, param_dtype=param)


def _check_device(precision: str, device: torch.device) -> None:
    """A precision the device cannot run is a user error naming the alternative."""
    dt = device.type
    if precision_facts(precision).fp8:
        check_fp8_device(device)
    if precision == "tf32" and dt == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        raise ConfigError("--precision tf32 needs an Ampere or newer GPU; use --precision fp32 or fp16")
    if precision_facts(precision).matmul_type == "bf16" and dt == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--precision {precision} needs a GPU with bfloat16 (Ampere or newer); use --precision fp16")
    if precision == "fp16":
        if dt == "cpu" and not _cpu_fp16_autocast_works():
            raise ConfigError(
                f"--precision fp16 needs CPU float16 autocast, which torch {torch.__version__} lacks; "
                "use --precision bf16 on CPU"
            )
        if dt not in ("cpu", "cuda"):
            raise ConfigError(f"--precision fp16 is not supported on {dt}; use --precision fp32")


def make_precision(precision: str, device: torch.device) -> Precision:
    """Validate ``precision`` for ``device`` and set the global matmul precision (TF32).
    The dtypes come from :mod:`memtrain.techniques.facts`, which estimate and flops read too."""
    facts = precision_facts(precision)
    # TF32 is a process-wide switch: set it explicitly every run (on or off) so that one bench row
    # cannot leak into the next; through both of torch's APIs (memtrain.devices.tf32), so that a
    # value set through the other one before (transformers sets the new one) neither stays nor
    # breaks a reader.
    set_tf32(facts.tf32)
    _check_device(precision, device)
    param, autocast = torch_dtypes(facts)
    scaler = torch.amp.GradScaler(device.type) if facts.scaler else None
    return Precision(precision, device.type, autocast_dtype=autocast, param_dtype=param, scaler=scaler)
