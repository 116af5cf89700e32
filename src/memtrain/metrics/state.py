"""Measured training state: the optimizer's state bytes and what one rank holds of weights,
gradients and optimizer state.

These read real tensors, so they are measurement and live here rather than beside the
techniques that create the state (techniques never import metrics; the train loop wires the
two together). The analytic counterpart of :func:`optimizer_state_bytes` is
``memtrain.analysis.estimate.predicted_optimizer_state``, which predicts the same figure from a
parameter table without any tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from memtrain.metrics.storage import storage_bytes

__all__ = ["ShardedStateBytes", "optimizer_state_bytes", "state_bytes_per_param"]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of storage held in ``optimizer.state``, each storage counted once.

    State is created lazily on the first ``step``; before it this is 0. Includes the small
    per-tensor extras (step counters, block scales, quantization maps) because they are real
    memory, which is why a low-bit optimizer is not exactly 1/4 or 1/8 of AdamW. Sharded
    (DTensor) state counts this rank's shard.
    """
    return storage_bytes(list(optimizer.state.values()))


def state_bytes_per_param(optimizer: torch.optim.Optimizer, model: nn.Module) -> float:
    """Optimizer state bytes per trainable parameter of ``model`` (8.0 for FP32 AdamW)."""
    # parameters() yields a tied (shared) parameter once, like named_parameters().
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return optimizer_state_bytes(optimizer) / n if n else 0.0


class ShardedStateBytes:
    """What this rank holds of the training state (weights, gradients, optimizer state),
    read at every optimizer step (gradients are complete then) and kept at its maximum.

    Unlike the MemoryMeter's peak (everything alive at the worst moment of a step, gathered
    weights and activations included), this is exactly the part ZeRO stages divide by the
    number of ranks: compare it with ``memtrain estimate --world-size N --shard ...``.
    """

    def __init__(self, model: nn.Module, optimizer: Any, state_owner: Any) -> None:
        self.parameters = self.gradients = self.optimizer = 0
        self._model, self._state_owner = model, state_owner
        if hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(self._before_step)
            optimizer.register_step_post_hook(self._after_step)

    def _before_step(self, *_: Any) -> None:
        params = list({id(p): p for p in self._model.parameters()}.values())
        self.parameters = max(self.parameters, storage_bytes(params))
        self.gradients = max(self.gradients, storage_bytes([p.grad for p in params if p.grad is not None]))

    def _after_step(self, *_: Any) -> None:
        self.optimizer = max(self.optimizer, storage_bytes(list(self._state_owner.state.values())))

    def to_dict(self) -> dict[str, int]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer}
