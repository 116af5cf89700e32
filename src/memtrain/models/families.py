"""The model-family seam: which family claims a config, how it builds its model (torch side).

One seam for every command that runs a step: a :class:`ModelFamily` in :data:`FAMILIES`
says which configs it claims, how to build its model and how the techniques map onto it.
:func:`build_model` builds through it, ``memtrain.techniques.prepare_model`` (called by the
step harness, :mod:`memtrain.training.step`) applies the techniques through the family's mapping
(``memtrain.techniques.order.PREPARERS``, by the family's name: models never import techniques), and
:func:`data_tokenizer` names the tokenizer the data must be read with. A new model family is
one more entry in :data:`FAMILIES` (claimed before the GPT, which takes every config left).

This module builds models, so it imports torch; what a ``--model`` names (:mod:`.spec`) and
:func:`memtrain.models.is_hf` stay torch-free for the analytic commands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from memtrain.config.run import RunConfig
from memtrain.models.gpt import GPT
from memtrain.models.hf import build_hf_model
from memtrain.models.spec import is_hf
from memtrain.models.tokenizer import data_tokenizer

__all__ = ["FAMILIES", "ModelFamily", "build_model", "data_tokenizer", "family_of"]


@dataclass(frozen=True)
class ModelFamily:
    """One kind of model memtrain trains: the one seam a model family plugs into."""

    name: str
    claims: Callable[[RunConfig], bool]  # whether a config names a model of this family
    # (cfg, with_weights) -> the model on the current default device and dtype
    build: Callable[[RunConfig, bool], nn.Module]


def _build_gpt(cfg: RunConfig, with_weights: bool) -> nn.Module:
    return GPT(cfg.model)  # randomly initialized: memtrain's GPT has no pretrained weights


def _build_hf(cfg: RunConfig, with_weights: bool) -> nn.Module:
    return build_hf_model(cfg, with_weights=with_weights)


# Claimed in order; the GPT takes every config no other family claims.
FAMILIES: list[ModelFamily] = [
    ModelFamily("transformers", is_hf, _build_hf),  # mapping: memtrain.techniques.hf_mapping
    ModelFamily("gpt", lambda cfg: True, _build_gpt),
]


def family_of(cfg: RunConfig) -> ModelFamily:
    """The family that claims ``cfg``'s model."""
    return next(f for f in FAMILIES if f.claims(cfg))


def build_model(cfg: RunConfig, with_weights: bool = True) -> nn.Module:
    """The model ``cfg`` describes, on the current default device and dtype: our GPT, or a
    transformers causal LM (pretrained weights when the source has them and ``with_weights``)."""
    return family_of(cfg).build(cfg, with_weights)
