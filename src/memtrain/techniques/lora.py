"""LoRA: train low-rank adapters instead of the weights (Hu et al. 2021), via peft.

``apply_lora`` swaps each targeted ``nn.Linear`` (``qkv``, ``proj``, ``fc``, ``fc_out``) for
peft's ``lora.Linear``, which computes ``W x + (alpha / r) * B (A x)`` with ``A`` (r x in) and
``B`` (out x r, zero at start, so training starts from the base model). Everything else,
embeddings and LayerNorms included, is frozen, so gradients and optimizer state exist only for
the adapters: ``r * (in + out)`` parameters per targeted Linear instead of ``in * out``.

peft's ``inject_adapter_in_model`` is used rather than ``get_peft_model`` because it mutates
the module in place: the model stays a :class:`memtrain.models.gpt.GPT` with its ``loss_fn`` and
``attn_fn`` seams, so the train loop and the other techniques need not know LoRA is on.
Under ``--precision bf16-pure`` the adapters are kept in FP32 (as peft's ``get_peft_model``
does by default): they are tiny, and their updates then need no stochastic rounding.

``merge_lora`` folds the adapters back into plain Linear weights for export.
"""

from __future__ import annotations

import copy
from typing import cast

import torch
import torch.nn as nn

from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.models.gpt import GPT
from memtrain.models.spec import ALL_LINEAR
from memtrain.runtime.extras import import_extra

__all__ = ["apply_lora", "lora_target_names", "merge_adapters_in_place", "merge_lora"]


def lora_target_names(model: nn.Module) -> list[str]:
    """The Linear module names inside the Transformer blocks that may carry adapters.

    The LM head is left out: it is tied to the token embedding, and an adapter on it would
    untie the two.
    """
    blocks = getattr(model, "blocks", model)
    names = {name.rsplit(".", 1)[-1] for name, m in blocks.named_modules() if isinstance(m, nn.Linear) and name}
    return sorted(names)


def _parse_targets(model: nn.Module, spec: str) -> list[str]:
    valid = lora_target_names(model)
    if spec == ALL_LINEAR:  # peft's name for every Linear of the blocks, as on a transformers --model
        return valid
    targets = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in targets if t not in valid]
    if not targets or unknown:
        what = f"unknown --lora-targets {', '.join(unknown)}" if unknown else "--lora-targets is empty"
        raise ConfigError(f"{what}; choose from {', '.join(valid)} (comma-separated), or all-linear")
    return list(dict.fromkeys(targets))


def apply_lora(model: GPT, tech: TechniqueConfig) -> None:
    """Add LoRA adapters in place when ``tech.lora_rank > 0`` and freeze everything else."""
    if not tech.lora_rank:
        return
    if not 0.0 <= tech.lora_dropout < 1.0:
        raise ConfigError(f"--lora-dropout must be in [0, 1), got {tech.lora_dropout}")
    if tech.lora_alpha <= 0:
        raise ConfigError(f"--lora-alpha must be positive, got {tech.lora_alpha}")
    targets = _parse_targets(model, tech.lora_targets)

    # Imported on demand: peft is slow to import, and an optional extra (memtrain[lora]).

    import_extra("peft")
    from peft import LoraConfig, inject_adapter_in_model
    from peft.tuners.tuners_utils import cast_adapter_dtype

    config = LoraConfig(
        r=tech.lora_rank,
        lora_alpha=tech.lora_alpha,  # type: ignore[arg-type]  # peft annotates lora_alpha as int; it takes a float
        lora_dropout=tech.lora_dropout,
        target_modules=targets,
        bias="none",
    )
    inject_adapter_in_model(config, model)
    # FP32 adapters on a BF16/FP16 base, as peft's get_peft_model does by default.
    cast_adapter_dtype(model, "default", autocast_adapter_dtype=True)
    # peft already freezes the base; this states the contract independently of its version.
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)


def merge_lora(model: nn.Module) -> GPT:
    """A plain GPT whose Linear weights include the adapters (``W + alpha/r * B A``).

    ``model`` is left as it is (a deep copy is merged), so a run can export mid-training.
    The result has no peft modules, every parameter trainable, and the same logits as the
    adapted model (in eval mode, where LoRA dropout is off).
    """
    merged = copy.deepcopy(getattr(model, "_orig_mod", model))
    merge_adapters_in_place(merged)
    if not isinstance(merged, GPT):
        raise TypeError(f"merge_lora expects a GPT, got {type(merged).__name__}")
    return merged


def merge_adapters_in_place(model: nn.Module) -> None:
    """Fold every peft LoRA layer of ``model`` (any model: our GPT, a transformers model) into
    its base layer and put the plain base layer back in its place; every parameter trainable.

    A base layer is a Linear, or a mixture-of-experts block whose experts are stacked tensors
    (transformers' Mixtral, Qwen3-MoE): peft adapts each such tensor with a ``ParamWrapper``,
    one wrapped around the other per tensor, and the outermost one merges those inside it."""
    from peft.tuners.lora import LoraLayer

    names = {name for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    outermost = [(name, m) for name, m in model.named_modules()
                 if name in names and not any(name.startswith(outer + ".") for outer in names)]
    for name, layer in outermost:
        # Merged in FP32 and rounded once to the base's dtype: a BF16 merge would round B A and
        # then the sum. One layer at a time, so the FP32 copy is one layer's, not the model's.
        base: nn.Module = layer.get_base_layer()
        stored = next((p.dtype for p in base.parameters() if p.is_floating_point()), torch.float32)
        cast(nn.Module, layer).float()  # peft's LoRA layers are Modules; its LoraLayer mixin is typed apart
        # safe_merge: fail on NaN/inf instead of writing them. A ParamWrapper merges the wrappers
        # nested in it too (its own unload method, which peft's merge_and_unload calls).
        unload = getattr(layer, "unload_and_optionally_merge_module", None)
        if unload is not None:
            unload(merge=True, safe_merge=True, adapter_names=None)
        else:
            layer.merge(safe_merge=True)
        base.to(stored)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, base)
    for p in model.parameters():
        p.requires_grad_(True)
