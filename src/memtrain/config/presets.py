"""Model presets for ``memtrain estimate --model NAME`` and ``memtrain plan --model NAME``.

Each preset is a dict of :class:`memtrain.config.run.ModelConfig` fields (so any flag given next to
``--model`` overrides it) plus an :class:`memtrain.analysis.estimate.Arch`.

The GPT-2 presets are exactly our model (GPT-2 small/medium/large/XL shapes, Radford et al.
2019). The LLaMA presets are *not* our model: LLaMA uses RMSNorm, a SwiGLU MLP (three
matrices), rotary positions, no biases, an untied head and (LLaMA 3) grouped-query attention.
They carry ``Arch("llama")`` so the estimator counts their real parameters (6.74B)
and substitutes those pieces in the activation inventory; that part is an approximation no run
here can check (our trainer builds only the GPT-2 architecture), and ``--trace`` refuses them.

One name, one model: a model that has a bundled transformers config (``llama-3-8b`` in
``models/configs/``) has no preset here, and a spelling that differs from a known name only in
case or punctuation (``llama3-8b``) is refused with the name to use (:mod:`memtrain.models.source`).
"""

from __future__ import annotations

from typing import Any

from memtrain.config.archs import GPT2_ARCH, LLAMA_ARCH, Arch
from memtrain.errors import ConfigError

__all__ = ["PRESETS", "preset", "preset_names"]

_GPT2: dict[str, Any] = {"vocab_size": 50257, "max_seq_len": 1024, "dropout": 0.1, "bias": True,
                         "untie_embeddings": False}
_LLAMA: dict[str, Any] = {"max_seq_len": 4096, "dropout": 0.0, "bias": False, "untie_embeddings": True}

PRESETS: dict[str, tuple[dict[str, Any], Arch, str]] = {
    "default": ({}, GPT2_ARCH, "memtrain's default model (ModelConfig defaults, ~16M parameters)"),
    "gpt2": ({**_GPT2, "d_model": 768, "n_heads": 12, "n_layers": 12, "d_ff": 3072}, GPT2_ARCH,
             "GPT-2 small, 124M"),
    "gpt2-medium": ({**_GPT2, "d_model": 1024, "n_heads": 16, "n_layers": 24, "d_ff": 4096}, GPT2_ARCH,
                    "GPT-2 medium, 355M"),
    "gpt2-large": ({**_GPT2, "d_model": 1280, "n_heads": 20, "n_layers": 36, "d_ff": 5120}, GPT2_ARCH,
                   "GPT-2 large, 774M"),
    "gpt2-xl": ({**_GPT2, "d_model": 1600, "n_heads": 25, "n_layers": 48, "d_ff": 6400}, GPT2_ARCH,
                "GPT-2 XL, 1.56B"),
    "llama-7b": ({**_LLAMA, "vocab_size": 32000, "d_model": 4096, "n_heads": 32, "n_layers": 32,
                  "d_ff": 11008, "max_seq_len": 2048}, LLAMA_ARCH,
                 "LLaMA 7B (6.74B; RMSNorm/SwiGLU/RoPE approximated, analytic only)"),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset(name: str) -> tuple[dict[str, Any], Arch]:
    """The ModelConfig fields and architecture of preset ``name`` (ConfigError if unknown)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --model {name!r}; choose one of {', '.join(PRESETS)}")
    fields, arch, _ = PRESETS[name]
    return dict(fields), arch
