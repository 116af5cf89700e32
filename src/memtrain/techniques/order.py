"""The one order in which techniques are applied to a finished model (see the package docstring):

    lora -> attention backend -> activation checkpointing -> loss -> compile -> distributed wrap

with ``--precision fp8``'s Linear swap (:mod:`memtrain.techniques.fp8`) right after lora: it
replaces Linear modules, so it runs before checkpointing wraps blocks and compile traces them.
"""

from __future__ import annotations

from typing import Callable

import torch

from memtrain.attention.apply import apply_attention
from memtrain.config.run import ConfigError, RunConfig
from memtrain.distributed.wrapping import apply_distributed
from memtrain.models.families import family_of
from memtrain.models.gpt import GPT
from memtrain.techniques.checkpointing import apply_checkpointing
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.fp8 import apply_fp8
from memtrain.techniques.hf_mapping import prepare_hf_model
from memtrain.techniques.lora import apply_lora
from memtrain.techniques.loss import apply_loss
from memtrain.techniques.precision import Precision

__all__ = ["PREPARERS", "prepare_model"]


def prepare_model(model: torch.nn.Module, cfg: RunConfig, device: torch.device, precision: Precision) -> torch.nn.Module:
    """Move ``model`` to ``device`` and apply every technique of ``cfg.technique`` in order,
    through the mapping of the model's family (:data:`PREPARERS`).

    Returns the module to train: the model itself (compile works in place), or its
    DistributedDataParallel wrapper (FSDP2 shards the model in place).
    """
    return PREPARERS[family_of(cfg).name](model, cfg, device, precision)


def prepare_gpt(model: torch.nn.Module, cfg: RunConfig, device: torch.device, precision: Precision) -> torch.nn.Module:
    """memtrain's GPT: each technique's own function, in the documented order."""
    if cfg.technique.qlora:
        raise ConfigError("--qlora quantizes a transformers --model's base weights; memtrain's GPT has none to quantize")
    if not isinstance(model, GPT):
        raise TypeError(f"{cfg.model.model!r} is memtrain's GPT, but the model given is a {type(model).__name__}")
    tech = cfg.technique
    model = model.to(device=device, dtype=precision.param_dtype)
    apply_lora(model, tech)
    apply_fp8(model, tech)
    apply_attention(model, tech, device, precision)
    apply_checkpointing(model, tech)
    answers_only = cfg.data.loss_on == "completion"  # a micro-batch may then hold no target
    # --packing pad's pads are ignored targets too (every row holds a real one: answers_only stays off)
    apply_loss(model, tech, device, ignores_targets=cfg.data.ignores_targets)
    model.answers_only = answers_only
    model = apply_compile(model, tech)  # type: ignore[assignment]  # compile returns a wrapper module around the GPT
    return apply_distributed(model, tech, device, precision)


# Each model family's technique mapping, by its name in memtrain.models.FAMILIES. The mappings
# live with the techniques (models never import techniques); a new family adds its entry here.
PREPARERS: dict[str, Callable[..., torch.nn.Module]] = {
    "transformers": prepare_hf_model,  # the family builds an HFCausalLM
    "gpt": prepare_gpt,
}
