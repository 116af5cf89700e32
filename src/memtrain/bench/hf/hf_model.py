"""The Trainer side's model: the same architecture and initial weights as memtrain's side."""

from __future__ import annotations

import tempfile
import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from memtrain.bench.hf.mapping import HFPlan
from memtrain.config.run import ConfigError, RunConfig
from memtrain.inference.export import hf_config, load_gpt_weights
from memtrain.models import is_hf
from memtrain.models.gpt import GPT
from memtrain.runtime.env import seed_everything

if TYPE_CHECKING:  # transformers is imported when a model is built, not with this module
    from transformers import PreTrainedModel


def build_hf_model(cfg: RunConfig, plan: HFPlan, init_from_memtrain: bool = True,
                   device: Optional[torch.device] = None) -> PreTrainedModel:
    """The transformers model the Trainer trains for ``cfg``, starting where memtrain starts.

    Built on ``device`` (default: torch's default device, which an open ``torch.device`` context
    sets) in the plan's weight dtype, as memtrain builds its side
    (:func:`memtrain.training.step.building_on`): the same random draws on the same device's
    generator give both sides the same initial weights on a GPU too, and an 8B model is not first
    built in FP32 on the host (minutes) before the Trainer moves it.

    Our GPT (no ``--model``): a ``GPT2LMHeadModel`` of ``cfg.model``'s architecture through
    memtrain's one conversion (:mod:`memtrain.inference.export`, with the padded vocabulary so that both
    sides train the same embedding table), loaded with the weights of ``memtrain.models.gpt.GPT``
    built under the same seed. A transformers model (``--model SPEC``): the very
    ``AutoModelForCausalLM`` memtrain builds through its model seam
    (:func:`memtrain.models.build_model`), under the same seed, without memtrain's wrapper. The
    weights are random unless told to match memtrain's (``init_from_memtrain``; under fake tensors
    nothing can be matched nor read).
    """
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.training.step import building_on

    device = device or torch.get_default_device()
    with building_on(device, getattr(torch, plan.weight_dtype)):
        model = transformers_model(cfg, init_from_memtrain) if is_hf(cfg) else _gpt2_model(cfg, plan, init_from_memtrain)
    if plan.quantization is None:
        return model
    # bitsandbytes quantizes only inside from_pretrained: the initial weights go through a
    # temporary checkpoint (an 8B model: 16 GB of BF16 written and read once, before any timing),
    # and the unquantized model is dropped before the quantized one is loaded.
    if is_fake(next(model.parameters())):
        raise ConfigError("the Trainer side's QLoRA base is quantized by bitsandbytes as it loads, which fake tensors "
                          "cannot run; use --no-maxbatch or --maxbatch-method measure")
    config = model.config  # memtrain's edits (attention, sliding window, no KV cache) go through config.json
    with tempfile.TemporaryDirectory(prefix="memtrain-hf-qlora-") as tmp:
        model.save_pretrained(tmp)
        del model
        return _load_quantized(tmp, config, plan, device)


def _load_quantized(folder: str, config: Any, plan: HFPlan, device: torch.device) -> PreTrainedModel:
    """The checkpoint in ``folder`` loaded through bitsandbytes' 4-bit loader, as a QLoRA user
    loads one (``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = dict(plan.quantization or {})
    q["bnb_4bit_compute_dtype"] = getattr(torch, q["bnb_4bit_compute_dtype"])
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(**q), dtype=getattr(torch, plan.weight_dtype),
        device_map={"": device}, attn_implementation=config._attn_implementation,
        trust_remote_code=False)  # a checkpoint memtrain just wrote; never run code it names
    loaded.config.use_cache = config.use_cache
    return loaded


def _gpt2_model(cfg: RunConfig, plan: HFPlan, init_from_memtrain: bool) -> PreTrainedModel:
    """``GPT2LMHeadModel`` of our GPT's architecture, with our GPT's initial weights."""
    if not cfg.model.bias:
        # The conversion would give GPT-2 zero biases, which the Trainer would then train.
        raise ConfigError("GPT-2 always has biases; the Hugging Face comparison needs --bias (the default)")
    from transformers import GPT2LMHeadModel

    config = hf_config(cfg, padded_vocab=True)
    config.use_cache = False  # training: no KV cache
    config._attn_implementation = plan.attn_implementation
    model = GPT2LMHeadModel(config)
    if init_from_memtrain:
        seed_everything(cfg.train.seed)  # what memtrain.training.train does right before building its GPT
        ours = GPT(cfg.model)
        if ours.num_parameters() != model.num_parameters():
            raise RuntimeError(f"parameter counts differ: memtrain {ours.num_parameters():,}, "
                               f"GPT2LMHeadModel {model.num_parameters():,}")
        load_gpt_weights(model, ours, padded_vocab=True)
        del ours
    return model


def transformers_model(cfg: RunConfig, init_from_memtrain: bool = True) -> PreTrainedModel:
    """``--model SPEC``'s transformers model as memtrain builds it (same config edits: the
    attention implementation, sliding window, no KV cache), unwrapped for the Trainer.

    With ``init_from_memtrain`` the global seed is set first, as ``memtrain.training.train`` does right
    before building, and a directory's ``*.safetensors`` weights are loaded as memtrain loads
    them; the same initial weights on both sides (a test checks the first losses agree)."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.models import build_model

    if init_from_memtrain:
        seed_everything(cfg.train.seed)
    wrapped = build_model(cfg, with_weights=init_from_memtrain)
    return wrapped.lm  # type: ignore[union-attr,return-value]  # HFCausalLM holds the transformers model


def apply_hf_lora(model: PreTrainedModel, plan: HFPlan) -> Any:
    """Wrap with peft's LoRA as a Trainer user would (``get_peft_model``): ``model`` itself
    without LoRA, else peft's ``PeftModel`` around it."""
    if plan.lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft notes that fan_in_fan_out is set for GPT-2's Conv1D
        return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **plan.lora))

