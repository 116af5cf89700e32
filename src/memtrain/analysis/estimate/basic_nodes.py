"""The small ops every part of the op inventory builds (embedding, attention, block, head):
dropout, a norm's saved statistics, and another name for a storage where an op allocates nothing."""

from __future__ import annotations

from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.simulator import Node


def rename_key(nodes: list[Node], old: str, new: str) -> None:
    """Let ``new`` name the storage ``old`` named (an op that allocates nothing)."""
    for n in nodes:
        n.out = [(new,) + tuple(o[1:]) if o[0] == old else o for o in n.out]
        n.inputs = [new if k == old else k for k in n.inputs]
        n.saves = [new if k == old else k for k in n.saves]
        n.grads = [(new if k == old else k, v) for k, v in n.grads]
        if n.grad_out is not None:
            n.grad_out = tuple(new if k == old else k for k in n.grad_out)


def dropout(nodes: list[Node], dm: Dims, name: str, x: str, out: str, numel: float, elt: float,
            requires_grad: bool = True, attention: bool = False) -> None:
    """Dropout in training: the CPU kernel keeps a float noise tensor (input dtype) for
    backward, CUDA's fused kernel a bool mask; either way the output is a new tensor. Without
    dropout the op returns its input: ``out`` is another name for ``x``. ``requires_grad``:
    whether ``x`` needs a gradient; when it does not (a frozen embedding's output under LoRA)
    autograd records nothing and the mask is freed with the op. ``attention``: the attention
    weights' dropout, the only one a Llama-style layer has (``Dims.branch_dropout``)."""
    if not dm.dropout or not (attention or dm.branch_dropout):
        rename_key(nodes, x, out)
        return
    mask = f"{name}.mask"
    # (The CPU kernel draws the noise, then multiplies: the product saves the noise before the
    # output exists, where a lazy recompute that stops at this op stops. CUDA's one kernel makes both.)
    nodes.append(Node(name, out=[(out, numel * elt), (mask, numel * (1 if dm.cuda else elt))],
                       inputs=[x], saves=[mask] if requires_grad else [],
                       grads=[(x, numel * elt)] if requires_grad else [],
                       made_before_save=() if dm.cuda else (mask,)))


def norm_stats(dm: Dims, layer: bool, name: str) -> list[tuple[str, float]]:
    """A norm's saved statistics, one (key, bytes) per tensor: LayerNorm's mean and rstd per token
    (``name.mean``, ``name.rstd``), RMSNorm's rstd. Two tensors, not one of twice the size: each
    meets --offload-activations' size floor on its own (between 128 and 255 float32 tokens neither
    does, and both stay on the device). The CPU LayerNorm kernel makes them in its input's dtype
    where the weights share it (bf16-pure: 2 bytes; +1.4% forward over the trace at 4 bytes, 7
    layers of width 12), float32 otherwise (autocast runs it in float32) and on CUDA."""
    if not layer:
        return [(f"{name}.rstd", dm.n * 4)]
    per = dm.n * (4 if dm.cuda else dm.r)
    return [(f"{name}.mean", per), (f"{name}.rstd", per)]
