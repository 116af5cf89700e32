"""The techniques mapped onto a transformers model (``--model SPEC``), in the documented order.

Each through the library that owns it: the attention backend is transformers'
``attn_implementation`` (chosen when :func:`memtrain.models.hf.build_hf_model` builds the model;
flash / mem-efficient are :mod:`memtrain.attention.hf`), LoRA is peft, QLoRA's NF4 base weights are torchao (CPU)
or bitsandbytes (CUDA), checkpointing/loss/compile and the distributed wrap (DDP, ZeRO-1,
FSDP2 per decoder layer) are memtrain's own technique functions.
The model family itself (building, the GPT-like seams) is :mod:`memtrain.models.hf`; this
mapping lives with the techniques so that models never import techniques.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from memtrain.config.run import ConfigError, RunConfig, TechniqueConfig
from memtrain.distributed.wrapping import apply_distributed
from memtrain.models.hf import HFCausalLM
from memtrain.models.placement import place_weights
from memtrain.models.qlora import nf4_unshardable, quantize_base_weights
from memtrain.models.spec import ALL_LINEAR, every_decoder_linear
from memtrain.techniques.checkpointing import apply_checkpointing
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.facts import transformers_checkpointing_error
from memtrain.techniques.fp8 import apply_fp8
from memtrain.techniques.loss import apply_loss

__all__ = ["apply_hf_lora", "lora_target_modules", "prepare_hf_model"]

def _check_logit_softcap(model: HFCausalLM, tech: TechniqueConfig) -> None:
    """Refuse a fused loss for a model that caps its logits: only the standard loss applies the cap."""
    if model.logit_softcap is not None and tech.loss != "standard":
        raise ConfigError(f"--loss {tech.loss}: --model {model.source_spec!r} caps its logits "
                          "(final_logit_softcapping), which only --loss standard applies; use --loss standard")


def _check_head_bias(model: HFCausalLM, tech: TechniqueConfig) -> None:
    """Refuse a fused loss for a model whose LM head has a bias (Phi-2, GPT-J): the fused losses
    take the head's weight alone, and only the standard loss runs the head itself. Said before
    the first step, naming the loss asked for (the forward's own refusal named --loss chunked
    for --loss naive too, and said nothing to do)."""
    if getattr(model.head, "bias", None) is not None and tech.loss != "standard":
        raise ConfigError(f"--loss {tech.loss} needs an LM head without a bias; --model {model.source_spec!r} has one: "
                          "use --loss standard")


def _check_supported(tech: TechniqueConfig, device: torch.device) -> None:
    """Refuse, before anything is applied, a technique a transformers model cannot take on ``device``."""
    if tech.attention == "flash-attn" and device.type != "cuda":
        raise ConfigError("--attention flash-attn (flash_attention_2) needs a CUDA GPU; use sdpa or flash on CPU")
    if tech.attention == "mem-efficient" and device.type != "cuda":
        raise ConfigError("--attention mem-efficient is a CUDA kernel; use sdpa or flash on CPU")
    if tech.attention == "flex" and device.type != "cuda":
        raise ConfigError("--attention flex has no CPU backward in this torch; use sdpa on CPU")
    if tech.qlora and not tech.lora_rank:
        raise ConfigError("--qlora quantizes the frozen base weights under LoRA; add --lora-rank 16")
    refusal = transformers_checkpointing_error(tech.checkpointing)
    if refusal is not None:
        raise ConfigError(refusal)


def lora_target_modules(targets: str) -> Any:
    """peft's target_modules: every decoder Linear for the GPT default, else the named ones."""
    if every_decoder_linear(targets):
        return ALL_LINEAR
    return [t.strip() for t in targets.split(",") if t.strip()]


def _check_targets_exist(model: HFCausalLM, targets: Any, spec: str, kinds: tuple[type, ...]) -> None:
    """Refuse a named target that no module of the model answers to.

    peft matches each name of a list as the last part(s) of a module's path and raises only when
    *no* name matches: a misspelt name beside a right one (``q_proj,v_prj``) trained without its
    adapters and without a word (memtrain's own GPT refuses an unknown name)."""
    if not isinstance(targets, list):
        return  # all-linear: peft's own rule
    paths = [n for n, _ in model.lm.named_modules()]
    missing = [t for t in targets if not any(p == t or p.endswith("." + t) for p in paths)]
    if missing:
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.lm.named_modules() if isinstance(m, kinds)})
        raise ConfigError(f"--lora-targets {spec!r}: {', '.join(missing)} names no module of --model "
                          f"{model.source_spec!r}; its Linear layers are {', '.join(linears)} (or all-linear)")


def _check_head_not_targeted(model: HFCausalLM, targets: Any, spec: str) -> None:
    """Refuse an adapter on the LM head where memtrain's loss reads the head's weight itself.

    The standard and chunked losses take ``head.weight`` (the chunked one never holds the
    logits), so peft's wrapper around the head never runs: its adapter would get no gradient
    (the backward failed outright when it was the only target). Only a head with a bias or a
    soft-capped model runs ``head(h)``."""
    if not isinstance(targets, list) or model.logit_softcap is not None or getattr(model.head, "bias", None) is not None:
        return  # all-linear leaves the output layer out (peft's rule)
    head_paths = [n for n, m in model.lm.named_modules() if m is model.head]
    hit = [t for t in targets if any(p == t or p.endswith("." + t) for p in head_paths)]
    if hit:
        rest = ",".join(t for t in targets if t not in hit)
        change = f"use --lora-targets {rest}" if rest else "name decoder Linears in --lora-targets (or all-linear)"
        raise ConfigError(f"--lora-targets {spec!r}: {', '.join(hit)} is the LM head, whose weight memtrain's loss "
                          f"reads directly, so its adapter would never train; {change}")


# peft's warning about its own rank/alpha patterns for stacked experts (see apply_hf_lora).
_PEFT_OWN_PATTERN_WARNING = r"The following (rank|alpha)_pattern keys did not match any targeted module"


def apply_hf_lora(model: HFCausalLM, tech: TechniqueConfig) -> None:
    """Add LoRA adapters in place with peft; only the adapters stay trainable."""
    if not tech.lora_rank:
        return
    from peft import LoraConfig, inject_adapter_in_model
    from transformers.pytorch_utils import Conv1D

    # GPT-2's projections are transformers' Conv1D, whose weight is stored (in, out): peft needs
    # fan_in_fan_out for them and otherwise switches it on itself with a UserWarning per layer.
    conv1d = any(isinstance(m, Conv1D) for m in model.lm.modules())
    _check_targets_exist(model, lora_target_modules(tech.lora_targets), tech.lora_targets, (nn.Linear, Conv1D))
    _check_head_not_targeted(model, lora_target_modules(tech.lora_targets), tech.lora_targets)
    lcfg = LoraConfig(r=tech.lora_rank, lora_alpha=tech.lora_alpha, lora_dropout=tech.lora_dropout,  # type: ignore[arg-type]
                      target_modules=lora_target_modules(tech.lora_targets), bias="none", fan_in_fan_out=conv1d)
    try:
        with warnings.catch_warnings():
            # memtrain gives peft no rank or alpha pattern: one on a mixture-of-experts model is
            # peft's own (twice the rank for Mixtral's fused gate_up_proj experts), applied to the
            # expert tensor, and peft's check of it looks at module names only, so it says the
            # pattern "matched no targeted module and was ignored" when it was not.
            warnings.filterwarnings("ignore", message=_PEFT_OWN_PATTERN_WARNING, category=RuntimeWarning)
            inject_adapter_in_model(lcfg, model.lm)
    except ValueError as exc:
        raise ConfigError(f"--lora-targets {tech.lora_targets!r}: {str(exc).splitlines()[0]}") from None
    for name, p in model.lm.named_parameters():
        p.requires_grad_("lora_" in name)


def _check_qlora_shards(model: HFCausalLM, tech: TechniqueConfig, device: torch.device) -> None:
    """QLoRA's 4-bit base weights under FSDP2 (zero2/fsdp), which splits every weight by rows.

    torchao's NF4Tensor implements FSDP2's all-gather hooks (torchtune's QLoRA recipe shards
    it), provided each weight's rows and 64 x 256-value scale blocks divide by the rank count.
    bitsandbytes' Params4bit (CUDA) carries its quantization state as an attribute of the
    parameter (``quant_state``), which the DTensor shard FSDP2 puts in its place does not
    carry, so that pairing is refused (not run here: no GPU). ddp and zero1 keep whole weights on every rank."""
    s = tech.distributed
    if not tech.qlora or s not in ("zero2", "fsdp") or not dist.is_initialized():
        return
    if device.type == "cuda":
        raise ConfigError(f"--qlora with --distributed {s} on CUDA: bitsandbytes' 4-bit weights cannot be sharded "
                          "by FSDP2 here; use --distributed ddp or zero1 (whole frozen weights on every rank)")
    n = dist.get_world_size()
    bad = nf4_unshardable(model, n)
    if bad:
        raise ConfigError(f"--qlora with --distributed {s}: {len(bad)} NF4 weight(s) (e.g. {bad[0]}) do not split into "
                          f"{n} equal shards (rows and 64x256-value scale blocks must divide by {n}); "
                          "use --distributed ddp or zero1, or fewer ranks")


def prepare_hf_model(model: HFCausalLM, cfg: RunConfig, device: torch.device, precision: Any) -> nn.Module:
    """Apply ``cfg.technique`` to a transformers model in the documented order
    (lora -> [qlora] -> [fp8] -> checkpointing -> loss -> compile -> distributed wrap); the attention
    backend was chosen when the model was built (``attn_implementation``). The distributed
    wrap is the GPT's own :func:`~memtrain.distributed.wrapping.apply_distributed`:
    DDP around the model, or FSDP2 ``fully_shard`` on each of ``model.blocks`` (the decoder
    layers, LoRA adapters and checkpoint wrappers included) and then the root (embeddings,
    final norm, LM head)."""
    tech = cfg.technique
    _check_supported(tech, device)
    _check_logit_softcap(model, tech)
    _check_head_bias(model, tech)
    place_weights(model, precision.param_dtype, device)  # rope's float32 inv_freq stays float32, as in transformers
    apply_hf_lora(model, tech)
    if tech.qlora:
        quantize_base_weights(model, device)
        _check_qlora_shards(model, tech, device)
    apply_fp8(model, tech)  # the decoder's Linears; the LM head stays in BF16
    apply_checkpointing(model, tech)
    answers_only = cfg.data.loss_on == "completion"  # a micro-batch may then hold no target
    # --packing pad's pads are ignored targets too (every row holds a real one: answers_only stays off)
    apply_loss(model, tech, device, ignores_targets=cfg.data.ignores_targets)
    model.answers_only = answers_only
    compiled = apply_compile(model, tech)
    return apply_distributed(compiled, tech, device, precision)  # last: it shards the final modules
