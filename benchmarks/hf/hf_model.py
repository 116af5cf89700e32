"""The Trainer side's model: the same architecture and initial weights as memtrain's side."""

from __future__ import annotations

import warnings

import torch

from memtrain.config.run import RunConfig
from memtrain.models import is_hf
from memtrain.runtime.env import seed_everything

from .mapping import HFPlan, gpt2_config_kwargs


def copy_gpt_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Load a ``memtrain.models.gpt.GPT``'s weights into a ``GPT2LMHeadModel`` of the same shape.

    GPT-2's Conv1D keeps (in, out) weights where nn.Linear keeps (out, in): those are
    transposed. The q, k, v order of the fused projection is the same on both sides.
    """
    linear = {"attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc", "mlp.fc_out": "mlp.c_proj"}
    out: dict[str, torch.Tensor] = {}
    for name, value in src.state_dict().items():
        if name == "lm_head.weight":
            if src.cfg.untie_embeddings:
                out["lm_head.weight"] = value
            continue
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            module, _, kind = rest.rpartition(".")
            if module in linear:
                target = f"transformer.h.{i}.{linear[module]}.{kind}"
                out[target] = value.t() if kind == "weight" else value
            else:
                out[f"transformer.h.{i}.{rest}"] = value
        else:
            out[f"transformer.{name}"] = value
    missing, unexpected = dst.load_state_dict(out, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to wte
    if missing or unexpected:
        raise RuntimeError(f"weight copy memtrain -> GPT-2 failed: missing {missing}, unexpected {unexpected}")


def build_hf_model(cfg: RunConfig, plan: HFPlan, init_from_memtrain: bool = True) -> torch.nn.Module:
    """The transformers model the Trainer trains for ``cfg``, starting where memtrain starts.

    Our GPT (no ``--model``): a ``GPT2LMHeadModel`` of ``cfg.model``'s architecture, loaded with
    the weights of ``memtrain.models.gpt.GPT`` built under the same seed. A transformers model
    (``--model SPEC``): the very ``AutoModelForCausalLM`` memtrain builds through its model seam
    (:func:`memtrain.models.build_model`), under the same seed, without memtrain's wrapper. The
    weights are random unless told to match memtrain's (``init_from_memtrain``; under fake tensors
    nothing can be matched nor read).
    """
    if is_hf(cfg):
        return transformers_model(cfg, init_from_memtrain)
    from transformers import GPT2Config, GPT2LMHeadModel

    from memtrain.models.gpt import GPT

    config = GPT2Config(**gpt2_config_kwargs(cfg.model))
    config._attn_implementation = plan.attn_implementation
    model = GPT2LMHeadModel(config)
    if init_from_memtrain:
        seed_everything(cfg.train.seed)  # what memtrain.training.train does right before building its GPT
        ours = GPT(cfg.model)
        if ours.num_parameters() != model.num_parameters():
            raise RuntimeError(f"parameter counts differ: memtrain {ours.num_parameters():,}, "
                               f"GPT2LMHeadModel {model.num_parameters():,}")
        copy_gpt_weights(ours, model)
        del ours
    return model


def transformers_model(cfg: RunConfig, init_from_memtrain: bool = True) -> torch.nn.Module:
    """``--model SPEC``'s transformers model as memtrain builds it (same config edits: the
    attention implementation, sliding window, no KV cache), unwrapped for the Trainer.

    With ``init_from_memtrain`` the global seed is set first, as ``memtrain.training.train`` does right
    before building, and a directory's ``*.safetensors`` weights are loaded as memtrain loads
    them; the same initial weights on both sides (a test checks the first losses agree)."""
    from memtrain.models import build_model

    if init_from_memtrain:
        seed_everything(cfg.train.seed)
    wrapped = build_model(cfg, with_weights=init_from_memtrain)
    return wrapped.lm  # type: ignore[union-attr,return-value]  # HFCausalLM holds the transformers model


def apply_hf_lora(model: torch.nn.Module, plan: HFPlan) -> torch.nn.Module:
    """Wrap with peft's LoRA as a Trainer user would (``get_peft_model``)."""
    if plan.lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft notes that fan_in_fan_out is set for GPT-2's Conv1D
        return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **plan.lora))

