"""FP8 training: ``--precision fp8``, the Linears' matmuls on FP8 tensor cores (torchao float8).

torchao's ``convert_to_float8_training`` swaps each chosen ``nn.Linear`` for its ``Float8Linear``,
whose forward casts the input and the weight to ``float8_e4m3fn`` with one dynamic scale per
tensor (torchao's default "tensorwise" recipe) and multiplies them with ``torch._scaled_mm``;
backward casts the output gradient to ``float8_e5m2`` the same way. Everything else runs as
under ``--precision bf16``: FP32 master weights, gradients and optimizer state, BF16 autocast.

Which Linears: those of the Transformer blocks whose two dimensions divide by 16 (what
``torch._scaled_mm`` accepts, :func:`memtrain.techniques.facts.fp8_converts`). The LM head is
left in BF16: it is tied to the token embedding in memtrain's GPT, and its logits feed the loss
directly, where FP8's 3-bit mantissa costs most (torchtitan leaves ``output`` out too); the
embeddings are lookups, not matmuls.

Speed comes from torch.compile, which fuses the scale computation and casts into the
neighbouring kernels; eager, those casts are separate passes over every input and weight and
a step is usually slower than BF16's, so a run without ``--compile`` is warned about (torchtitan
likewise runs float8 compiled). Needs compute capability 8.9+ (L4, L40S, RTX 4090, H100,
H200): :func:`check_fp8_device` says what to change anywhere else.
"""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Optional

import torch
import torch.nn as nn

from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.runtime.extras import import_extra
from memtrain.runtime.notices import SlowPrecisionWarning
from memtrain.techniques.facts import FP8_DIM_MULTIPLE, precision_facts

__all__ = ["FP8_SKIPPED_NAMES", "apply_fp8", "check_fp8_device", "fp8_module_filter"]

# Linears left in high precision whatever their shape (module names' last part): the LM head.
FP8_SKIPPED_NAMES = ("lm_head",)


def check_fp8_device(device: torch.device) -> None:
    """Refuse ``--precision fp8`` on a device without FP8 tensor cores, naming the alternative;
    and without torchao, naming the extra that installs it."""
    need = precision_facts("fp8").min_capability
    assert need is not None
    wanted = f"a CUDA GPU with FP8 tensor cores (compute capability {need[0]}.{need[1]}+, e.g. H100)"
    if device.type != "cuda":
        raise ConfigError(f"--precision fp8 needs {wanted}; this device is {device.type}: use --precision bf16")
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) < need:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"--precision fp8 needs {wanted}; this GPU ({name}) is {cap[0]}.{cap[1]}: "
                          "use --precision bf16")
    import_extra("torchao")


def fp8_module_filter(module: nn.Module, fqn: str) -> bool:
    """torchao's ``module_filter_fn``: a block Linear both of whose dimensions divide by 16."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in FP8_SKIPPED_NAMES:
        return False
    n_out, n_in = module.weight.shape
    return n_in % FP8_DIM_MULTIPLE == 0 and n_out % FP8_DIM_MULTIPLE == 0


def _warn_uncompiled(tech: TechniqueConfig) -> Optional[str]:
    """The one-line warning for FP8 without ``--compile`` (eager casts are slow), or None."""
    if tech.compile:
        return None
    msg = ("--precision fp8 without --compile: torchao's FP8 casts run as separate eager kernels, "
           "so steps are usually slower than --precision bf16; add --compile")
    warnings.warn(msg, SlowPrecisionWarning, stacklevel=3)
    return msg


def apply_fp8(model: nn.Module, tech: TechniqueConfig, *, emulate: bool = False) -> int:
    """Under ``--precision fp8``, swap the model's qualifying Linears for torchao's Float8Linear in
    place; return how many were swapped (0 for any other precision).

    ``emulate``: torchao's emulated FP8 matmul (dequantize, then a high-precision matmul), which
    runs on a CPU: for tests of the conversion and of what it saves for backward; a run never
    sets it (the device check refuses a CPU first)."""
    if not precision_facts(tech.precision).fp8:
        return 0
    float8 = _torchao_float8()
    chosen = [name for name, m in model.named_modules() if fp8_module_filter(m, name)]
    if not chosen:
        raise ConfigError("--precision fp8: no Linear of this model has both dimensions divisible by "
                          f"{FP8_DIM_MULTIPLE}; use --precision bf16 (or --d-model/--d-ff multiples of {FP8_DIM_MULTIPLE})")
    float8.convert_to_float8_training(model, config=float8.Float8LinearConfig(emulate=emulate),
                                      module_filter_fn=fp8_module_filter)
    _warn_uncompiled(tech)
    return len(chosen)


def _torchao_float8() -> ModuleType:
    """torchao's float8 package (a ConfigError naming the lowbit extra when torchao is missing)."""
    import_extra("torchao")
    from torchao import float8  # optional package: imported only when --precision fp8 is used

    return float8
