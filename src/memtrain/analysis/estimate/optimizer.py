"""Optimizer state and step scratch of *our* optimizers, from the parameter catalogue."""

from __future__ import annotations

import math
from typing import Any, Iterable

from memtrain.analysis.estimate.params import ParamInfo
from memtrain.techniques.facts import (
    LOW_BIT_MIN_NUMEL,
    low_bit_quantizes,
    optimizer_state_rule,
    sr_adamw_scratch_numel,
    torchao_compiled_step,
)

# --------------------------------------------------------------------------- optimizer (ours)


def predicted_optimizer_state(params: Iterable[ParamInfo], optim: str, param_bytes: float,
                          block: int = 0) -> tuple[float, list[str]]:
    """Steady-state optimizer state for *our* optimizers over the trainable ``params``.

    ``block``: the low-bit optimizers' quantization block (``--optim-block``; 0 = torchao's
    default for ``optim``; bitsandbytes always uses 256 here).

    Returns (bytes, explanation lines). ``param_bytes`` is the dtype size of the weights (AdamW
    keeps its moments in the parameters' dtype: 2 x 4 B in fp32, 2 x 2 B under bf16-pure).
    """
    rule = optimizer_state_rule(optim)  # the one state rule (memtrain.techniques.facts)
    ps = [p for p in params if p.trainable]
    n = sum(p.numel * p.repeat for p in ps)
    n_tensors = sum(p.repeat for p in ps)
    if rule.factored:
        # torch.optim.Adafactor: no first moment; the second moment of a matrix (R, C) is factored
        # into a row (R) and a column (C) vector, full for vectors; plus a step tensor.
        total = 0.0
        for p in ps:
            if len(p.shape) >= 2:
                r, c = p.shape[-2], p.shape[-1]
                lead = math.prod(p.shape[:-2])
                total += (4 * lead * (r + c) + 4) * p.repeat
            else:
                total += (4 * p.numel + 4) * p.repeat
        return total, ["Adafactor: factored second moment (rows + columns per matrix), no first moment"]
    if rule.quantized:
        return _quantized_state_bytes(ps, rule, n, block, param_bytes)
    if rule.step_tensor:
        # AdamW: exp_avg + exp_avg_sq per parameter, plus a 4-byte float32 ``step`` tensor each.
        return (rule.states * param_bytes * n + 4 * n_tensors,
                [f"AdamW: 2 moments x {param_bytes:g} B x {n:,} trainable params"])
    return param_bytes * n, [f"SGD momentum: 1 buffer x {param_bytes:g} B x {n:,}"]


def _quantized_state_bytes(ps: list[ParamInfo], rule: Any, n: int, block: int,
                           param_bytes: float) -> tuple[float, list[str]]:
    """A low-bit AdamW's state: quantized codes + block scales on the tensors it quantizes; the
    others keep two full moments, in the weights' dtype (``param_bytes``) unless the optimizer
    makes them float32 (``OptimizerStateRule.unquantized_fp32``)."""
    bits = rule.state_bits
    block = rule.quant_block(block)
    plain = 4 if rule.unquantized_fp32 else param_bytes
    total = 0.0
    q = 0
    # Per tensor of the model: a fused table entry (ParamInfo.parts) is quantized, or not, tensor
    # by tensor, each with its own scales, lookup tables and step.
    for numel, repeat in ((n, p.repeat) for p in ps for n in (p.parts or (p.numel,))):
        if low_bit_quantizes(numel, block):
            q += numel * repeat
            # codes + one fp32 scale per block, for each of the 2 states; torchao also keeps
            # a 256-entry (8-bit) or 16-entry (4-bit) fp32 lookup table per state.
            codes = numel * bits / 8
            scales = 4 * numel / block
            qmap = 4 * (2 ** bits) if rule.qmap else 0
            total += (2 * (codes + scales + qmap) + 4) * repeat
        else:
            total += (2 * plain * numel + 4) * repeat
    lines = [f"{bits}-bit AdamW: 2 states x {bits} bits + fp32 scale per {block} elements on "
             f"{q:,} of {n:,} params; the rest (tensors < {LOW_BIT_MIN_NUMEL} elements or not a multiple of "
             f"{block}) keep {plain:g}-byte states"]
    return total, lines


def optimizer_temporaries(params: list[ParamInfo], optim: str, param_bytes: float, weight_decay: float,
                          precision: str) -> float:
    """Scratch the optimizer step allocates at its worst moment (steady state).

    ``precision`` (``--precision``) picks the optimizer ``optim`` names: under bf16-pure,
    ``adamw`` is torchao's stochastic-rounding AdamW, not torch's. A fused table entry that the
    model holds as separate tensors (a transformers Llama's q/k/v) says so itself (ParamInfo.parts)."""
    ps = [p for p in params if p.trainable]
    if ps and precision == "bf16-pure" and optim == "adamw":
        # memtrain's bucketed stochastic-rounding AdamW (memtrain.techniques.sr_adamw): while it
        # updates a bucket it holds four copies of it (weights, gradients, both moments, in the
        # weights' dtype); buckets are planned per param group in model order.
        bucket = max(sr_adamw_scratch_numel(_model_order([p for p in ps if len(p.shape) >= 2])),
                     sr_adamw_scratch_numel(_model_order([p for p in ps if len(p.shape) < 2])))
        return 4 * bucket * param_bytes
    if not ps or torchao_compiled_step(optim, precision):
        # torchao's step (the low-bit AdamWs) is one compiled (fused) kernel per parameter that
        # computes the FP32 update, (de)quantizes and rounds in registers: no scratch above the
        # state, as MemoryMeter measures the steady step (docs/estimation.md, "Optimizer step
        # scratch"); the tensors bf16-pure's AdamW updates alone are the same.
        return 0.0
    # (Per tensor of the model: a transformers Llama's q/k/v and gate/up table entries are
    # separate tensors there, each updated on its own: _tensor_numels.)
    largest = max(n for p in ps for n in _tensor_numels(p)) * param_bytes
    if optim == "adamw":
        # Single-tensor AdamW works one parameter at a time: denom = sqrt(v) / c builds two
        # buffers of the parameter's size, and the local ``denom`` keeps the previous
        # parameter's alive until it is replaced. So the peak of a param group (memtrain's two:
        # matrices, then vectors, each in model order) is max(previous + 2 x current), as
        # MemoryMeter measures it (docs/estimation.md, "Optimizer step scratch").
        worst = 0.0
        for group in ([p for p in ps if len(p.shape) >= 2], [p for p in ps if len(p.shape) < 2]):
            previous = 0.0
            for numel in (n for p in group for n in _tensor_numels(p)):
                current = numel * param_bytes
                worst = max(worst, previous + 2 * current)
                previous = current
        return worst
    if optim == "adamw-foreach":
        # _foreach_sqrt(exp_avg_sqs) materializes one buffer per parameter of a param group.
        decay = sum(p.numel * p.repeat for p in ps if len(p.shape) >= 2) * param_bytes
        no_decay = sum(p.numel * p.repeat for p in ps if len(p.shape) < 2) * param_bytes
        return max(decay, no_decay)
    if optim == "sgd":
        # d_p = grad.add(param, alpha=weight_decay): one buffer for the largest parameter.
        return largest if weight_decay else 0.0
    if optim == "adafactor":
        return _adafactor_scratch(ps, param_bytes)
    return 0.0  # fused kernels (adamw-fused, bitsandbytes) update in place


def _adafactor_scratch(ps: list[ParamInfo], param_bytes: float) -> float:
    """torch.optim.Adafactor's step scratch. torch runs its single-tensor loop unless ``foreach``
    is passed, on CUDA too (its docstring: the foreach version holds about the parameters' size
    more), and memtrain passes none. One param group at a time (memtrain's two: matrices, then
    vectors, each in model order): a matrix's ``var_estimate`` (its size) lives until the next
    matrix's replaces it, so max(previous + current); a vector's squared gradient and its
    ``var_estimate`` clone come next to the previous vector's: max(previous + 2 x current).
    Measured with MemoryMeter (torch 2.13; tests/test_estimate.py::test_adafactor_step_scratch_follows_its_loop):
    with a large embedding first the step holds it and its neighbour, not twice the embedding."""
    worst = 0.0
    for group in ([p for p in ps if len(p.shape) >= 2], [p for p in ps if len(p.shape) < 2]):
        previous = 0.0
        for p in group:
            for numel in _tensor_numels(p):
                current = numel * param_bytes
                worst = max(worst, previous + (current if len(p.shape) >= 2 else 2 * current))
                previous = current
    return worst


# A bound on the tensors :func:`_model_order` lists: the buckets' plan is settled long before
# (a bucket holds at most SR_ADAMW_BUCKET_NUMEL values), and an answer stays O(1) in the depth.
_MODEL_ORDER_MAX = 1 << 16


def _model_order(params: list[ParamInfo]) -> list[int]:
    """The element counts of the model's tensors behind ``params``, in the model's order: a
    table entry that stands for ``repeat`` blocks (the compressed table) is one run of its
    block's entries, repeated; a fused entry the model holds as separate tensors is split."""
    out: list[int] = []
    run: list[ParamInfo] = []

    def flush() -> None:
        for _ in range(run[0].repeat if run else 0):
            for p in run:
                out.extend(_tensor_numels(p))

    for p in params:
        if run and (p.block != run[0].block or p.repeat != run[0].repeat):
            flush()
            run = []
            if len(out) > _MODEL_ORDER_MAX:
                return out
        run.append(p)
    flush()
    return out


def clip_scratch(params: list[ParamInfo], grad_bytes: float) -> float:
    """What ``clip_grad_norm_`` holds at its busiest (torch 2.13's ``_get_total_norm``): one 0-d
    norm per gradient tensor (``torch._foreach_norm``, in the gradients' dtype) beside their
    ``torch.stack``, before the total norm. Negligible on a real model; on a model a few bytes
    wide, whose optimizer step holds little else, its largest moment (a width-6 Llama under LoRA,
    42 adapters: 336 B, with SGD's 80 B of scratch the step's peak, -2.1% under the trace left out)."""
    n = sum(len(_tensor_numels(p)) * p.repeat for p in params if p.trainable)
    return 2 * n * grad_bytes


def _tensor_numels(p: ParamInfo) -> list[int]:
    """The model's tensors behind one table entry. The table fuses q/k/v into ``attn.qkv`` and a
    SwiGLU's gate and up into ``mlp.fc`` (as our GPT and Phi-3 hold them, and transformers' GPT-2
    its c_attn); a transformers Llama, Qwen2, Mistral or Gemma holds separate Linears, listed q,
    k, v and gate, up (``ParamInfo.parts``: q is n_heads x head_dim rows, which a config's head_dim
    sets apart from the hidden size). Biases are left whole: every vector of a model fits one bucket."""
    return list(p.parts or (p.numel,))
