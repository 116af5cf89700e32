"""FLOP and byte arithmetic for a training step: the rule of thumb, counted FLOPs, the roofline.

The rule of thumb (Kaplan et al. 2020; PaLM appendix B): a training step costs
6 FLOPs per parameter per token (2 forward, 4 backward) for the matmuls against weights,
plus the attention matmuls QK^T and AV, which have no parameters:
2 matmuls x 2 FLOPs x seq x d_model per token per layer forward, x3 with backward
= 12 * n_layers * d_model * seq per token (heads x head_dim for d_model where a transformers
config sets a head_dim apart from d_model / heads: :func:`.rules.attention_width`). The
position embedding is a lookup (no FLOPs),
so it is left out of the parameter term; the tied token embedding is counted once, for
the LM-head matmul. Causal masking does not halve the count: the math and SDPA kernels
compute the full score matrix.

Counted FLOPs (:func:`count_step`, :func:`counted_flops_per_step`) come from
``torch.utils.flop_counter.FlopCounterMode`` on one real training step of the configured
model (techniques applied), run under ``FakeTensorMode``: every aten op is dispatched with
its true shapes and dtypes but no memory is allocated and no arithmetic done, so the default
model at batch 64 counts in about a second on a CPU. A second dispatch mode, stacked on the
counter, sees the same ops and attributes each one to an operation class (``qkv``,
``softmax``, ``lm_head``...) by the module running it (the counter's own module tracker)
and the op's name; it also sums the bytes each op reads and writes. The per-class FLOPs add
up to the counter's total exactly (checked on every count).

Three things the counter does not count are added analytically, with the constants below:

* element-wise work (softmax, LayerNorm, GELU, dropout, the loss's log-softmax, adds):
  ``FlopCounterMode`` registers formulas for matmuls and attention kernels only, so it counts
  0 for these. They are a fraction of a percent of the step but they decide the roofline:
  their FLOP/byte is tiny.
* the optimizer update (``OPTIMIZER_FLOPS_PER_PARAM``), and gradient clipping;
* their bytes (``optimizer_bytes_per_param``), as the minimum a fused kernel moves.

Why bytes are summed per dispatched op rather than derived by hand for each class: the same
code then measures any technique (LoRA adapters, a fused attention kernel, a chunked loss)
without a formula per technique. The model is eager PyTorch, where every aten op is a kernel
that reads its inputs from memory and writes its outputs back, so the sum of input and output
sizes per op is the traffic an eager step moves (caches ignored). A compiled model fuses
element-wise chains and moves less; the bytes here describe eager execution.

Sub-modules: :mod:`.rules` (the rule of thumb, optimizer and clipping constants),
:mod:`.classes` (operation classes and the count tables), :mod:`.recorder` (the dispatch
recorder) and :mod:`.count` (:func:`count_step`): what the train loop needs for MFU, re-exported
here. Above the step, and not imported here: :mod:`.roofline` (the roofline, the reconciliation
with the rule and :func:`~memtrain.analysis.flops.roofline.flops_report`, which read the
parameter catalogue of :mod:`memtrain.analysis.estimate`) and :mod:`.profile` (measured time per
class; it trains).
"""

from __future__ import annotations

from memtrain.analysis.flops.classes import (
    ELEMENTWISE_FLOPS,
    LABELS,
    MATMUL_CLASSES,
    OP_CLASSES,
    PHASES,
    ClassCount,
    StepCount,
    classify,
)
from memtrain.analysis.flops.count import count_step, counted_flops_per_step
from memtrain.analysis.flops.recorder import op_bytes
from memtrain.analysis.flops.rules import (
    CLIP_FLOPS_PER_PARAM,
    OPTIMIZER_FLOPS_PER_PARAM,
    optimizer_bytes_per_param,
    rule_flops_per_token,
)

__all__ = [
    "CLIP_FLOPS_PER_PARAM",
    "ELEMENTWISE_FLOPS",
    "LABELS",
    "MATMUL_CLASSES",
    "OPTIMIZER_FLOPS_PER_PARAM",
    "OP_CLASSES",
    "PHASES",
    "ClassCount",
    "StepCount",
    "classify",
    "count_step",
    "counted_flops_per_step",
    "op_bytes",
    "optimizer_bytes_per_param",
    "rule_flops_per_token",
]
