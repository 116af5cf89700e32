"""ZeRO stage 1 that shards *within* tensors: every rank keeps the optimizer state of its
dim-0 chunk of every parameter (``--distributed zero1``).

Why hand-written: torch's ``ZeroRedundancyOptimizer`` hands *whole* tensors to ranks, so a
model dominated by one tensor (the tied 50257-row token embedding is ~80% of memtrain's
default model) keeps almost all of the optimizer state on one rank. DeepSpeed's ZeRO-1 (flat
partitions) and FSDP2 (dim-0 shards) split inside tensors, but FSDP2 also shards gradients
and weights (that is zero2/fsdp here) and DeepSpeed needs CUDA; no torch API does ZeRO-1
within tensors on DDP's all-reduced gradients. So this class does it, with the few torch
pieces it needs:

* rank ``r`` owns rows ``[r*c, (r+1)*c)`` of each parameter's dim 0 (``c = ceil(rows / N)``,
  the split of ``torch.chunk``/FSDP2; the last ranks may own fewer or no rows);
* its inner optimizer (same class, same hyper-parameters) steps *views* of those rows, so the
  update lands in the parameter itself: no copy of the weight shard is kept, and the state
  (Adam's two moments) has the shard's shape: ~1/N of DDP's;
* the view's gradient is the same rows of the all-reduced gradient DDP leaves in ``p.grad``;
* after the step every rank broadcasts its rows in place, so all ranks hold the same full
  weights for the next forward (gloo's ``all_gather`` needs equal sizes; per-tensor in-place
  broadcasts need neither padding nor a gather buffer).

The outer object is a ``torch.optim.Optimizer`` over the full parameters, so LR schedulers,
gradient clipping, the loss scaler and step hooks see what they see for DDP.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["ShardedZeRO1", "dim0_range"]


def dim0_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows ``[start, end)`` of a ``rows``-row tensor that ``rank`` owns (``torch.chunk``'s split)."""
    per = -(-rows // world_size)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


class ShardedZeRO1(torch.optim.Optimizer):
    """``optimizer_class`` over this rank's dim-0 chunk of each parameter; see the module docstring.

    Args:
        param_groups: the parameter groups (full parameters, with their hyper-parameters).
        optimizer_class: the optimizer to run on the chunks (e.g. ``torch.optim.AdamW``).
        rank, world_size: this rank and the number of ranks (default: the process group's).
        **defaults: that class's constructor arguments.
    """

    def __init__(self, param_groups: list[dict[str, Any]], optimizer_class: type, rank: Optional[int] = None,
                 world_size: Optional[int] = None, **defaults: Any) -> None:
        super().__init__(param_groups, defaults)
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        # (parameter, the view of its rows this rank owns, their range); and every rank's range
        # per parameter, in the parameter order all ranks share (the broadcasts must match).
        self._owned: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        self._ranges: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []
        local_groups = []
        for group in self.param_groups:
            views = []
            for p in group["params"]:
                rows = p.shape[0] if p.dim() else 1
                ranges = [dim0_range(rows, r, self.world_size) for r in range(self.world_size)]
                self._ranges.append((p, ranges))
                start, end = ranges[self.rank]
                if end > start:
                    view = (p.detach() if p.dim() else p.detach().view(1))[start:end]
                    self._owned.append((p, view, start, end))
                    views.append(view)
            local_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": views})
        # A group may be empty on a rank that owns no rows of its (small) tensors; optimizers
        # refuse empty groups, so keep a group list entry per outer group only where it has views.
        self._local_index = [i for i, g in enumerate(local_groups) if g["params"]]
        self.optim = optimizer_class([local_groups[i] for i in self._local_index], **defaults)

    def sync_param_groups(self) -> None:
        """Copy the hyper-parameters (LR set by a scheduler, ...) to the inner optimizer."""
        for i, local in zip(self._local_index, self.optim.param_groups):
            local.update({k: v for k, v in self.param_groups[i].items() if k != "params"})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.sync_param_groups()
        for p, view, start, end in self._owned:
            if p.grad is not None:  # the same rows of the (all-reduced) full gradient
                view.grad = (p.grad if p.dim() else p.grad.view(1))[start:end]
        self.optim.step()
        for _, view, _, _ in self._owned:
            view.grad = None  # do not keep the gradient buffer alive through the view
        self._broadcast_rows()
        return loss

    def _broadcast_rows(self) -> None:
        if self.world_size == 1:
            return
        for p, ranges in self._ranges:
            flat = p.detach() if p.dim() else p.detach().view(1)
            for r, (start, end) in enumerate(ranges):
                if end > start:
                    dist.broadcast(flat[start:end], src=r)
