"""Predict the memory of a training step by component, without running it.

Pure arithmetic on the same config objects a run uses (no torch import), so an estimate and a
measurement always describe the same run. Three parts:

1. **Model state** (exact for any size): parameter counts from the model shape, then weights,
   gradients and optimizer state in bytes for the configured precision, optimizer, LoRA and
   sharding (:func:`param_table`, :func:`predicted_optimizer_state`).
2. **The step's timeline**: a small storage-lifetime simulation over the op inventory of *our*
   model (what each op allocates, what autograd saves, when it is freed, what backward
   allocates). It replays forward, loss, backward block by block (with recomputation under
   activation checkpointing) and the optimizer step, and reports the largest total with its
   phase and its breakdown in the five categories that :class:`memtrain.metrics.MemoryMeter`
   measures. Walking the timeline instead of adding closed-form terms is what makes the peak
   right when it moves (loss backward for a large vocabulary, the top block's backward for long
   sequences, the optimizer step for large models).
3. **Rules of thumb** from the literature (:data:`OPTIMIZER_RULES`, :func:`model_state_rule`):
   the bytes per parameter quoted by the Hugging Face docs and the ZeRO paper, reported next to
   the implementation-exact numbers so a reader can see where they agree.

The formulas, their sources (HF "model memory anatomy", ZeRO, Korthikanti et al. 2022) and what
differs in this implementation are in docs/estimation.md.

Sub-modules, lowest first: :mod:`.params` (the parameter catalogue), :mod:`.rules` (literature
rules of thumb), :mod:`.optimizer` (our optimizers' state), :mod:`.simulator` (the generic
storage-lifetime simulator), :mod:`.dims` (the sizes the inventory's builders share),
:mod:`.basic_nodes` (dropout, norm statistics: ops every part of the inventory builds),
:mod:`.attention_nodes` (the attention's ops, every kernel),
:mod:`.linear_nodes` (a Linear's ops: autocast casts, LoRA, FP8, NF4),
:mod:`.embedding_nodes` (the embedding, the token ids, what every layer is handed),
:mod:`.head_nodes` (the final norm, the LM head and the loss),
:mod:`.block_nodes` (one block's ops),
:mod:`.inventory` (the op inventory as the simulator's segments),
:mod:`.explain` (explanation lines), :mod:`.training` (:func:`estimate`) and :mod:`.inference`.
"""

from __future__ import annotations

from memtrain.analysis.estimate.inference import estimate_inference
from memtrain.analysis.estimate.optimizer import predicted_optimizer_state
from memtrain.analysis.estimate.params import ParamInfo, param_count, param_table, parse_count, shape_for_params
from memtrain.analysis.estimate.rules import OPTIMIZER_RULES, model_state_rule
from memtrain.analysis.estimate.training import Estimate, estimate
from memtrain.analysis.limits import check_analytic_size
from memtrain.config.archs import GPT2_ARCH, LLAMA_ARCH, Arch

__all__ = [
    "Arch",
    "GPT2_ARCH",
    "LLAMA_ARCH",
    "OPTIMIZER_RULES",
    "Estimate",
    "ParamInfo",
    "estimate",
    "estimate_inference",
    "model_state_rule",
    "predicted_optimizer_state",
    "check_analytic_size",
    "param_count",
    "param_table",
    "parse_count",
    "shape_for_params",
]
