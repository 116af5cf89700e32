"""Optimizer state and step scratch of *our* optimizers, from the parameter catalogue."""

from __future__ import annotations

import math
from typing import Any, Iterable

from memtrain.analysis.estimate.params import ParamInfo
from memtrain.techniques.facts import (
    LOW_BIT_MIN_NUMEL,
    low_bit_quantizes,
    optimizer_state_rule,
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
        return _quantized_state_bytes(ps, rule, n, block)
    if rule.step_tensor:
        # AdamW: exp_avg + exp_avg_sq per parameter, plus a 4-byte float32 ``step`` tensor each.
        return (rule.states * param_bytes * n + 4 * n_tensors,
                [f"AdamW: 2 moments x {param_bytes:g} B x {n:,} trainable params"])
    return param_bytes * n, [f"SGD momentum: 1 buffer x {param_bytes:g} B x {n:,}"]


def _quantized_state_bytes(ps: list[ParamInfo], rule: Any, n: int, block: int) -> tuple[float, list[str]]:
    """A low-bit AdamW's state: quantized codes + block scales on the tensors it quantizes."""
    bits = rule.state_bits
    block = rule.quant_block(block)
    total = 0.0
    q = 0
    for p in ps:
        if low_bit_quantizes(p.numel, block):
            q += p.numel * p.repeat
            # codes + one fp32 scale per block, for each of the 2 states; torchao also keeps
            # a 256-entry (8-bit) or 16-entry (4-bit) fp32 lookup table per state.
            codes = p.numel * bits / 8
            scales = 4 * p.numel / block
            qmap = 4 * (2 ** bits) if rule.qmap else 0
            total += (2 * (codes + scales + qmap) + 4) * p.repeat
        else:
            total += (2 * 4 * p.numel + 4) * p.repeat
    lines = [f"{bits}-bit AdamW: 2 states x {bits} bits + fp32 scale per {block} elements on "
             f"{q:,} of {n:,} params; the rest (tensors < {LOW_BIT_MIN_NUMEL} elements or not a multiple of "
             f"{block}) keep fp32 states"]
    return total, lines


def optimizer_temporaries(params: list[ParamInfo], optim: str, param_bytes: float, weight_decay: float,
                          precision: str) -> float:
    """Scratch the optimizer step allocates at its worst moment (steady state).

    ``precision`` (``--precision``) picks the optimizer ``optim`` names: under bf16-pure,
    ``adamw`` is torchao's stochastic-rounding AdamW, not torch's."""
    ps = [p for p in params if p.trainable]
    if not ps or torchao_compiled_step(optim, precision):
        # torchao's step (the low-bit AdamWs; bf16-pure's stochastic-rounding AdamW) is one
        # compiled (fused) kernel per parameter that computes the FP32 update, (de)quantizes and
        # rounds in registers: no scratch above the state, as MemoryMeter measures the steady
        # step (docs/estimation.md, "Optimizer step scratch").
        return 0.0
    largest = max(p.numel for p in ps) * param_bytes
    if optim == "adamw":
        # Single-tensor AdamW works one parameter at a time: denom = sqrt(v) / c builds two
        # buffers of the parameter's size, and the local ``denom`` keeps the previous
        # parameter's alive until it is replaced. So the peak of a param group (memtrain's two:
        # matrices, then vectors, each in model order) is max(previous + 2 x current), as
        # MemoryMeter measures it (docs/estimation.md, "Optimizer step scratch").
        worst = 0.0
        for group in ([p for p in ps if len(p.shape) >= 2], [p for p in ps if len(p.shape) < 2]):
            previous = 0.0
            for p in group:
                current = p.numel * param_bytes
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
        # torch.optim.Adafactor works on one parameter at a time with two parameter-sized
        # buffers (the squared gradient, then the normalized update). Measured (torch 2.13).
        return 2 * largest
    return 0.0  # fused kernels (adamw-fused, bitsandbytes) update in place
