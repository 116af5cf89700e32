"""Models: memtrain's own GPT (the default) and any transformers causal LM (``--model SPEC``).

One seam for every command that runs a step: :func:`build_model` returns the module for a
config, ``memtrain.techniques.prepare_model`` applies the techniques to either kind, and
:func:`data_tokenizer` names the tokenizer the data must be read with.

    spec.py       what --model SPEC names (preset, bundled config, path, hf:ORG/NAME)
    hf.py         HFCausalLM (GPT's forward/loss/blocks seams) and the technique mapping
    qlora.py      NF4 base weights (torchao on CPU, bitsandbytes on CUDA)
    tokenizer.py  the model's own tokenizer for the data pipeline
    configs/      public architecture hyper-parameters of full-size models (no weights)
"""

from __future__ import annotations

import torch.nn as nn

from memtrain.config import RunConfig
from memtrain.models.spec import bundled_names, is_gpt_preset, load_config, resolve

__all__ = ["build_model", "is_hf", "data_tokenizer", "bundled_names", "load_config", "resolve"]


def is_hf(cfg: RunConfig) -> bool:
    """Whether ``cfg`` trains a transformers model rather than memtrain's GPT."""
    return not is_gpt_preset(cfg.model.model)


def build_model(cfg: RunConfig, with_weights: bool = True) -> nn.Module:
    """The model ``cfg`` describes, on the current default device and dtype: our GPT, or a
    transformers causal LM (pretrained weights when the source has them and ``with_weights``)."""
    if is_hf(cfg):
        from memtrain.models.hf import build_hf_model

        return build_hf_model(cfg, with_weights=with_weights)
    from memtrain.model import GPT

    return GPT(cfg.model)


def data_tokenizer(cfg: RunConfig):  # type: ignore[no-untyped-def]
    """The tokenizer for ``cfg``'s data (None: memtrain's GPT-2 BPE)."""
    from memtrain.models.tokenizer import data_tokenizer as _dt

    return _dt(cfg)
