"""Activation checkpointing: keep fewer activations in the forward pass, recompute them in
the backward pass (``--checkpointing none|full|every:K|sqrt|selective``).

Unit of checkpointing: a whole Transformer block. A checkpointed block keeps only its
input during the forward pass and runs its forward a second time during backward, so its
internal activations (the attention scores, the d_ff-wide MLP hidden, LayerNorm outputs,
dropout masks) never stay alive together across the model.

Policies (L = number of blocks):

* ``full``: every block. Saves the most; costs one extra forward of the blocks.
* ``every:K``: blocks ``0, K, 2K, ...`` (``i % K == 0``), i.e. ``ceil(L / K)`` blocks.
  Counting from the first block on purpose: the last block's activations are consumed
  first by the backward pass, so recomputing them saves nothing at the peak, while an
  early block's activations would otherwise sit through the whole backward pass.
  (torchtitan's layer-level ``ac_freq`` picks the K-th, 2K-th, ... block instead.)
* ``sqrt``: ``every:K`` with ``K = round(sqrt(L))``, a middle point in the spirit of
  Chen et al. 2016 ("Training deep nets with sublinear memory cost"): about sqrt(L)
  blocks are recomputed.
* ``selective``: Megatron-LM's selective recomputation (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 4.2): every block keeps
  all its activations except the *attention core* (q k^T scores, scaling, mask, softmax,
  attention dropout, probabilities @ v), which is checkpointed: it keeps only q, k, v and
  runs again in backward. The s x s tensors, the part of a layer's activations that grows
  with the sequence, are never kept; the recompute costs the two attention matmuls.
* ``selective-matmul``: every block, with torch's selective activation checkpointing
  (``create_selective_checkpoint_contexts``): the outputs of matrix multiplications and
  fused attention kernels are SAVED (with math attention that includes the s x s scores),
  everything cheap (LayerNorm, GELU, softmax, dropout, masking, residual adds) is
  recomputed. The recompute costs almost no FLOPs. (This was ``selective`` before
  ``selective`` became the paper's policy.)

Cost against transformers' own ``gradient_checkpointing_enable(gradient_checkpointing_kwargs=
{"use_reentrant": False})`` on a transformers model: the same call (``torch.utils.checkpoint``,
non-reentrant, RNG state preserved) around the same function (each decoder layer's ``forward``;
the rotary cos/sin and the causal mask are built once by the model, outside the layers; the
final norm and the loss stay outside), so a checkpointed step recomputes the same FLOPs and runs
the same aten operators (tests/test_checkpointing_parity.py counts both).

Numerics: non-reentrant ``torch.utils.checkpoint`` with ``preserve_rng_state=True``
restores the RNG state before the recompute, so dropout draws the same masks and the loss
and every gradient are bitwise equal to the model without checkpointing (tested).

How a block is wrapped: its ``forward`` is replaced, on the instance, by a callable that
runs the class's forward under ``torch.utils.checkpoint.checkpoint``. The module tree is
left alone, so ``state_dict`` keys, ``named_parameters`` names (which the optimizer,
LoRA and FSDP see) and ``model.blocks[i].attn`` stay exactly as in the plain model.
(``checkpoint_wrapper`` from ``torch.distributed`` would insert a
``_checkpoint_wrapped_module`` level into every parameter name.) ``torch.compile``
traces ``torch.utils.checkpoint`` natively, so compiling afterwards composes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memtrain.config.run import TechniqueConfig
from memtrain.techniques.facts import checkpoint_policy

__all__ = [
    "apply_checkpointing",
    "checkpointed_blocks",
    "is_checkpointed",
    "selective_policy",
    "SAVED_OPS",
]


def _aten_ops(*names: str) -> frozenset:
    """The default overloads of the named aten ops that exist in this torch build (the fused
    attention kernels differ between versions and builds)."""
    ops = set()
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None and hasattr(packet, "default"):
            ops.add(packet.default)
    return frozenset(ops)


# Ops whose outputs selective checkpointing keeps: the expensive ones (O(n * d^2) or
# O(n^2 * d) FLOPs) whose outputs are comparatively small. Everything else is recomputed.
SAVED_OPS = _aten_ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",  # composite (it reaches the dispatcher as addmm/mm), listed for safety
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Save matmul and attention-kernel outputs, recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    # A fresh pair of contexts for each checkpointed call (they hold that call's cache).
    return create_selective_checkpoint_contexts(selective_policy)


def checkpointed_call(
    forward: Callable[..., Any],
    context_fn: Optional[Callable[[], tuple[Any, Any]]],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``forward`` under non-reentrant checkpointing (RNG state preserved for dropout).

    Without gradients (evaluation, generation) it runs ``forward`` as is: no backward will
    replay it, and ``checkpoint`` would still save the CPU and device RNG states and set up its
    saved-tensor hooks at every call. transformers' own ``GradientCheckpointingLayer`` skips it
    the same way."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)  # type: ignore[arg-type]  # context_fn is one of checkpoint's keyword arguments


def _wrap_attention_core(block: nn.Module) -> None:
    """Checkpoint ``block.attn.attn_fn`` (q, k, v -> attention output): Megatron's selective
    recomputation. The attention backend is installed before checkpointing, so this wraps
    whichever kernel runs (math, SDPA, banded, flex)."""
    attn = block.attn
    if isinstance(attn.attn_fn, functools.partial) and attn.attn_fn.func is checkpointed_call:  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module
        raise ValueError("attention core is already checkpointed")
    attn.attn_fn = functools.partial(checkpointed_call, attn.attn_fn, None)  # type: ignore[arg-type,union-attr]  # torch types nn.Module attributes as Tensor | Module


def _wrap(block: nn.Module, selective: bool) -> None:
    """Replace ``block.forward`` on the instance by its checkpointed version.

    A ``functools.partial`` of a module-level function over the bound class forward (not a
    closure): ``copy.deepcopy`` and pickling then rebind it to the copied block.
    """
    if is_checkpointed(block):
        raise ValueError("block is already checkpointed")
    original = type(block).forward.__get__(block)
    block.forward = functools.partial(
        checkpointed_call, original, _selective_contexts if selective else None
    )


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_checkpointing`` wrapped this module (whole, or its attention core)."""
    fwd = module.__dict__.get("forward")
    if isinstance(fwd, functools.partial) and fwd.func is checkpointed_call:
        return True
    core = getattr(getattr(module, "attn", None), "attn_fn", None)
    return isinstance(core, functools.partial) and core.func is checkpointed_call


def checkpointed_blocks(policy: str, n_layers: int) -> list[int]:
    """Indices of the blocks a policy checkpoints (see the module docstring; the rule is
    :class:`memtrain.techniques.facts.CheckpointPolicy`'s, which estimate and flops read too)."""
    return checkpoint_policy(policy).blocks(n_layers)


def apply_checkpointing(model: nn.Module, tech: TechniqueConfig) -> None:
    """Checkpoint ``model.blocks`` in place as ``tech.checkpointing`` says."""
    policy = checkpoint_policy(tech.checkpointing)
    kind = policy.kind
    if kind == "none":
        return
    blocks = model.blocks
    for i in policy.blocks(len(blocks)):  # type: ignore[arg-type]  # torch types nn.Module attributes as Tensor | Module
        if kind == "selective":
            _wrap_attention_core(blocks[i])  # type: ignore[arg-type,index]  # torch types nn.Module attributes as Tensor | Module
        else:
            _wrap(blocks[i], selective=(kind == "selective-matmul"))  # type: ignore[arg-type,index]  # torch types nn.Module attributes as Tensor | Module
