"""Attention backend selection: ``--attention`` and ``--window`` become one kernel per block.

``apply_attention`` builds the kernel (:func:`build_attention`), then proves it runs here:
one tiny forward + backward in the run's dtype, with the run's dropout, inside the same forced
SDPA context the training steps will use (:func:`probe_attention`). A backend that cannot run
fails now with a one-line ConfigError naming the reason and the alternative; it never
silently falls back to another kernel, because a benchmark row labelled "flash" must measure
flash.

What runs where (torch 2.13; see docs/attention.md):

=============  ==============================  =========================================
--attention    CPU                             CUDA
=============  ==============================  =========================================
math           yes                             yes
sdpa           yes (flash kernel, math for     yes (flash / mem-efficient / cuDNN / math)
               dropout)
flash          fp32/bf16/fp16, no dropout      fp16/bf16, no --window (no mask support)
mem-efficient  no (no CPU kernel)              yes
flex           no (no CPU backward)            yes, no dropout
flash-attn     no                              with ``pip install flash-attn``, fp16/bf16
=============  ==============================  =========================================

With ``--window W``: math and sdpa use the banded kernels of :mod:`memtrain.attention.kernels`
(O(seq * W) memory on any device); flash and mem-efficient run SDPA per band with a band mask;
flex uses a sliding-window block mask and flash-attn its ``window_size``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import warnings
from typing import Optional

import torch
from torch.nn.attention import SDPBackend

from memtrain.attention.kernels import (
    AttentionFn,
    banded_attention,
    flash_attn_fn,
    flex_attention_fn,
    math_attention,
    sdpa_attention,
)
from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.errors import first_line
from memtrain.models.gpt import GPT

# The SDPA backend each forced --attention choice pins.
FORCED_SDPA: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "mem-efficient": SDPBackend.EFFICIENT_ATTENTION,
}

# Probe shape: small enough to cost nothing, long enough that a window of 4 takes the banded
# path (block + W - 1 < seq), so the probe runs the same code as training.
_PROBE_SEQ = 16
_PROBE_WINDOW = 4


def build_attention(kind: str, window: Optional[int] = None) -> AttentionFn:
    """The ``attn_fn(q, k, v, dropout_p)`` for ``--attention kind`` (and ``--window``).

    Pure construction: it checks nothing about the device (see :func:`apply_attention`).
    """
    if kind == "math":
        if window is None:
            return math_attention
        return functools.partial(banded_attention, window=window, kernel="math")
    if kind in ("sdpa", "flash", "mem-efficient"):
        backend = FORCED_SDPA.get(kind)
        if window is None:
            return functools.partial(sdpa_attention, backend=backend)
        return functools.partial(banded_attention, window=window, kernel="sdpa", backend=backend)
    if kind == "flex":
        return functools.partial(flex_attention_fn, window=window)
    if kind == "flash-attn":
        return functools.partial(flash_attn_fn, window=window)
    raise ConfigError(f"unknown --attention {kind!r}")


def apply_attention(model: GPT, tech: TechniqueConfig, device: torch.device, precision) -> None:
    """Install the configured attention kernel in every block, after checking it runs here.

    ``precision`` (a :class:`memtrain.techniques.precision.Precision`) gives the dtype the
    kernel will see: the autocast dtype if there is one, else the weights' dtype.
    """
    kind, window = tech.attention, tech.window
    dtype = attention_dtype(precision)
    dropout = model.blocks[0].attn.attn_dropout if len(model.blocks) else 0.0  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module
    _check_static(kind, device, dropout)  # type: ignore[arg-type]  # torch types nn.Module attributes as Tensor | Module
    fn = build_attention(kind, window)
    if kind != "math":  # the materialized baseline runs everywhere
        probe_attention(kind, window, device, dtype, model.cfg.head_dim, dropout)  # type: ignore[arg-type]  # torch types nn.Module attributes as Tensor | Module
    for block in model.blocks:
        block.attn.attn_fn = fn  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module


def _check_static(kind: str, device: torch.device, dropout: float) -> None:
    """Reject what is known to be impossible before building anything."""
    if kind == "flex":
        if device.type != "cuda":
            raise ConfigError(
                f"--attention flex needs CUDA: FlexAttention has no backward on {device.type} in "
                f"torch {torch.__version__.split('+')[0]}; use --attention sdpa (or --attention math "
                f"--window W for a banded sliding window on {device.type})"
            )
        if dropout > 0.0:
            raise ConfigError(
                f"--attention flex has no attention dropout (flex_attention takes no dropout_p) and "
                f"--dropout is {dropout}; set --dropout 0, or use --attention sdpa or flash-attn"
            )
    if kind == "flash-attn":
        if device.type != "cuda":
            raise ConfigError(
                f"--attention flash-attn needs CUDA (the flash_attn package has no {device.type} "
                f"kernel); use --attention sdpa, or --attention flash for SDPA's flash kernel"
            )
        if importlib.util.find_spec("flash_attn") is None:
            raise ConfigError(
                "--attention flash-attn needs the flash_attn package: pip install flash-attn "
                "(CUDA only), or use --attention flash for PyTorch's built-in flash kernel"
            )


def probe_attention(
    kind: str,
    window: Optional[int],
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    dropout: float,
) -> None:
    """Run ``kind`` once, forward and backward, on a tiny input; ConfigError if it cannot.

    The global RNG is forked so the probe does not shift the run's dropout or data streams.
    """
    fn = build_attention(kind, None if window is None else min(window, _PROBE_WINDOW))
    devices = [device] if device.type == "cuda" else []
    caught: list[warnings.WarningMessage] = []
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (
                torch.randn(1, 2, _PROBE_SEQ, head_dim, device=device, generator=g)
                .to(dtype)
                .requires_grad_()
                for _ in range(3)
            )
            out = fn(q, k, v, dropout)
            out.float().sum().backward()
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        raise ConfigError(_failure_message(kind, window, device, dtype, dropout, exc, caught)) from None


def _failure_message(
    kind: str, window: Optional[int], device: torch.device, dtype: torch.dtype, dropout: float,
    exc: BaseException, caught: list[warnings.WarningMessage],
) -> str:
    """One line: what cannot run, why (SDPA puts the real reason in warnings), what to use."""
    dt = str(dtype).removeprefix("torch.")
    what = f"--attention {kind} cannot run on {device.type} with {dt}"
    if window is not None:
        what += f" and --window {window}"
    if dropout > 0.0:
        what += f" and dropout {dropout}"
    return f"{what}: {_reason(exc, caught)}; {_advice(kind, window, device, dtype, dropout)}"


def _reason(exc: BaseException, caught: list[warnings.WarningMessage]) -> str:
    parts: list[str] = []
    for w in caught:
        # "Flash attention kernel not used because: (Triggered internally at ...)" -> keep text only.
        text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", str(w.message)).strip()
        if text and text not in parts and not text.endswith("because:"):
            parts.append(text.rstrip("."))
    first = first_line(exc)
    reason = ", ".join(parts) + f" ({first.rstrip('.')})" if parts else first.rstrip(".")
    return " ".join(reason.replace(";", ",").split())  # one line; ';' separates the advice


def _advice(kind: str, window: Optional[int], device: torch.device, dtype: torch.dtype, dropout: float) -> str:
    cpu = device.type != "cuda"
    if kind == "mem-efficient" and cpu:
        return f"PyTorch has no memory-efficient SDPA kernel on {device.type}; use --attention sdpa or flash"
    if kind == "flash" and cpu and dropout > 0.0:
        return f"the {device.type} flash kernel has no dropout; use --attention sdpa or set --dropout 0"
    if kind == "flash" and not cpu and window is not None:
        return "the flash kernel takes no mask; use --attention flex or flash-attn for a window on cuda, or --attention sdpa"
    if not cpu and dtype == torch.float32 and kind in ("flash", "flash-attn"):
        return "use --precision bf16 or fp16, or --attention sdpa"
    return "use --attention sdpa to let PyTorch pick a kernel"


def attention_dtype(precision) -> torch.dtype:
    """The dtype the attention kernel sees under ``precision``."""
    return precision.autocast_dtype or precision.param_dtype


__all__ = ["apply_attention", "build_attention", "probe_attention", "attention_dtype", "FORCED_SDPA"]
