"""A run's config written back as the ``memtrain train`` arguments that rebuild it (what plan
prints and what a report's row names), and the settings of a technique the config leaves off,
which train refuses and those arguments leave out.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from memtrain.config.run import DataConfig, ModelConfig, RunConfig, TechniqueConfig, TrainConfig

# Flags a printed `memtrain train` command always spells out, default or not: the choices a plan
# makes, and the attention, whose default depends on the model (memtrain.cli.config_from_args).
ALWAYS_SPELLED = ("precision", "attention", "checkpointing", "loss", "optim", "batch_size", "grad_accum", "seq_len")


def dormant_settings(cfg: RunConfig) -> dict[str, str]:
    """Settings of ``cfg`` that only shape a technique ``cfg`` leaves off, each with the flag that
    turns that technique on (``lora_targets`` -> ``--lora-rank N (e.g. 8)`` when LoRA is off)."""
    t = cfg.technique
    off: dict[str, str] = {}
    if not t.lora_rank:
        off.update(dict.fromkeys(("lora_alpha", "lora_dropout", "lora_targets"), "--lora-rank N (e.g. 8)"))
    if not t.compile:
        off.update(dict.fromkeys(("compile_mode", "compile_scope"), "--compile"))
    if t.optim != "adafactor":
        off["adafactor_relative_step"] = "--optim adafactor"
    if t.loss != "chunked":
        off["loss_chunk"] = "--loss chunked"
    if cfg.train.schedule == "constant":
        off["min_lr_ratio"] = "--schedule cosine (or linear)"
    return off


def train_flags(cfg: RunConfig) -> list[str]:
    """The ``memtrain train`` arguments that rebuild ``cfg``: --model first, then every field
    that differs from what train would use without it (for a transformers --model its shape
    fields come from the model and are left out), plus :data:`ALWAYS_SPELLED`. Parsing them
    with train's parser gives ``cfg`` back (tests/test_hf_user_flags.py checks it), less the
    :func:`dormant_settings` (train refuses a setting of a technique that is off)."""
    spec = cfg.model.model
    defaults: dict[str, Any] = {
        "model": ModelConfig.from_spec(spec),  # the model's own shape
        "data": DataConfig(), "technique": TechniqueConfig(), "train": TrainConfig(),
    }
    args: list[str] = ["--model", spec] if spec is not None else []
    dormant = dormant_settings(cfg)
    for section, default in defaults.items():
        current = getattr(cfg, section)
        for f in fields(current):
            value = getattr(current, f.name)
            if f.name == "model" or f.name in dormant or (value == getattr(default, f.name) and f.name not in ALWAYS_SPELLED):
                continue
            args += _flag(f.name, value)
    return args


def _flag(name: str, value: Any) -> list[str]:
    """One field as train's command line writes it (see memtrain.cli.add_config_flags)."""
    dashed = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        if name.startswith("no_"):  # a one-way switch (--no-cache): its default is off
            return [dashed] if value else []
        return [dashed if value else "--no-" + name.replace("_", "-")]
    if value is None:
        return [dashed, "none"]  # Optional fields read "none" as None (_coerce)
    return [dashed, repr(value) if isinstance(value, float) else str(value)]
