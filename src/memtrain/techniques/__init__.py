"""Memory techniques, each a function applied to a finished model in one documented order:

    lora -> attention backend -> activation checkpointing -> loss -> compile -> distributed wrap

Why this order: LoRA swaps Linear modules, so it must run before anything captures them;
the attention backend and the loss are plain attribute swaps on the model's seams;
checkpointing wraps whole blocks (so it sees the final attention and LoRA modules);
compile traces what all of those built; the distributed wrap shards the final modules.

``prepare_model`` runs that order; ``build_optimizer`` runs afterwards because it must see the
final set of trainable parameters (only the adapters under LoRA).
"""

from __future__ import annotations

import torch

from memtrain.config import RunConfig
from memtrain.model import GPT
from memtrain.techniques.attention import apply_attention
from memtrain.techniques.checkpointing import apply_checkpointing
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.distributed import apply_distributed
from memtrain.techniques.lora import apply_lora
from memtrain.techniques.loss import apply_loss
from memtrain.techniques.optim import build_optimizer
from memtrain.techniques.precision import Precision, make_precision

__all__ = ["prepare_model", "build_optimizer", "make_precision", "Precision"]


def prepare_model(model: torch.nn.Module, cfg: RunConfig, device: torch.device, precision: Precision) -> torch.nn.Module:
    """Move ``model`` to ``device`` and apply every technique of ``cfg.technique`` in order.

    Returns the module to train: the GPT itself (compile works in place), or its
    DistributedDataParallel wrapper (FSDP2 shards the GPT in place).
    """
    if not isinstance(model, GPT):  # a transformers model (memtrain.models): its own mapping
        from memtrain.models.hf import prepare_hf_model

        return prepare_hf_model(model, cfg, device, precision)  # type: ignore[arg-type]  # build_model made an HFCausalLM
    if cfg.technique.qlora:
        from memtrain.config import ConfigError

        raise ConfigError("--qlora quantizes a transformers --model's base weights; memtrain's GPT has none to quantize")
    tech = cfg.technique
    model = model.to(device=device, dtype=precision.param_dtype)
    apply_lora(model, tech)
    apply_attention(model, tech, device, precision)
    apply_checkpointing(model, tech)
    apply_loss(model, tech, device)
    model = apply_compile(model, tech)  # type: ignore[assignment]  # compile returns a wrapper module around the GPT
    return apply_distributed(model, tech, device, precision)
