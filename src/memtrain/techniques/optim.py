"""Optimizer construction: AdamW (plain, foreach, fused), SGD, and (see below) memory-lean ones.

Weight decay goes to matrices and embeddings only; biases and LayerNorm weights are not
decayed (as GPT-2 and nanoGPT do), which needs two parameter groups.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from memtrain.config import ConfigError, TechniqueConfig, TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Trainable parameters split into decayed (dim >= 2) and not decayed groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    # parameters() already yields a tied weight once.
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, tech: TechniqueConfig, train: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``tech.optim`` over the model's trainable parameters."""
    groups = param_groups(model, train.weight_decay)
    betas = (train.beta1, train.beta2)
    name = tech.optim
    if name in ("adamw", "adamw-foreach", "adamw-fused"):
        kw = {"foreach": False} if name == "adamw" else {"foreach": True} if name == "adamw-foreach" else {"fused": True}
        return torch.optim.AdamW(groups, lr=train.lr, betas=betas, **kw)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=train.lr, momentum=0.9)
    raise ConfigError(f"--optim {name} is not available in this build")
