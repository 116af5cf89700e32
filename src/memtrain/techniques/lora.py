"""LoRA adapters (interim: off only)."""

from __future__ import annotations

from memtrain.config import ConfigError, TechniqueConfig
from memtrain.model import GPT


def apply_lora(model: GPT, tech: TechniqueConfig) -> None:
    if tech.lora_rank:
        raise ConfigError("--lora-rank is not wired yet")
