"""``--optim adamw`` under ``--precision bf16-pure``: torchao's stochastic-rounding AdamW, with the
small tensors updated in flat buckets.

torchao's ``_AdamW(bf16_stochastic_round=True)`` computes each update in FP32 and rounds it
stochastically into the BF16 weight, one compiled call per tensor. A call costs a guard check,
the compiled wrapper and a launch whatever the tensor's size, which outweighs the update of a
small tensor: LoRA on every Linear of Llama-3-8B has 448 adapter tensors of 16,384 to 229,376
values, and at about 0.35 ms a call on a CPU (benchmarks/results/cpu-lora-optimizer) the
optimizer phase took 12.0 ms of a 67.6 ms LoRA step where the Trainer's (torch's multi-tensor
AdamW on FP32 adapters) took 2.3 ms.

:class:`BucketedSRAdamW` keeps torchao's update function (``single_param_adam``, the same math
and rounding) and its per-parameter state, so checkpoints, ``state_dict`` and the memory of the
state are unchanged, but calls it once per bucket: the weights, gradients and both moments of
up to :data:`~memtrain.techniques.facts.SR_ADAMW_BUCKET_NUMEL` values are concatenated, updated
in one compiled call (``dynamic=True``: one compile serves every bucket length), and copied
back with ``torch._foreach_copy_``. The cost is scratch at the optimizer step: the four copies
of the largest bucket (:func:`~memtrain.techniques.facts.sr_adamw_scratch_numel`; the estimate
counts it). Tensors above :data:`~memtrain.techniques.facts.SR_ADAMW_ALONE_NUMEL` values, DTensors
(FSDP2) and AMSGrad groups are left to torchao's own per-tensor step: their kernel outweighs the
call, and a DTensor's shards cannot be concatenated.

No library offers this: torch's multi-tensor optimizers have no stochastic rounding, and
torchao's steps one tensor at a time. Only the batching is memtrain's; the update is torchao's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torchao.optim import _AdamW
from torchao.optim.adam import single_param_adam

from memtrain.techniques.facts import sr_adamw_buckets

__all__ = ["BucketedSRAdamW"]


class BucketedSRAdamW(_AdamW):
    """torchao's ``_AdamW`` whose small dense tensors are updated a bucket at a time (see the
    module docstring). Constructed exactly as ``_AdamW``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # One compiled function for every bucket: the bucket length is symbolic, so a new length
        # does not recompile (torchao compiles per tensor shape, dynamic=False).
        self._bucket_update: Callable[..., None] = torch.compile(single_param_adam, fullgraph=True, dynamic=True)
        # How many tensors the last step left to torchao's per-tensor step. A memory trace runs
        # none (:meth:`_state_alone`); where it ran one eagerly (AMSGrad), memtrain.analysis.trace
        # says its optimizer phase is an upper bound.
        self.updated_alone = 0

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held: dict[torch.Tensor, Optional[torch.Tensor]] = {}
        # torchao's per-tensor compiles (one per shape) and the buckets' share the update's code
        # object, hence its dynamo cache limit: lifted as torchao lifts it in its own step.
        with torch._dynamo.utils.disable_cache_limit():
            try:
                for group in self.param_groups:
                    if group["amsgrad"]:
                        continue
                    live = [p for p in group["params"] if _bucketable(p)]
                    for p in live:
                        self._init_state(p)
                    # The moments are copied back through views: a loaded state could be strided.
                    live = [p for p in live if self.state[p]["exp_avg"].is_contiguous()
                            and self.state[p]["exp_avg_sq"].is_contiguous()]
                    for bucket in _buckets(live, self.state):
                        self._update_bucket(bucket, group)
                        for p in bucket:  # torchao's step below skips a tensor without a gradient
                            held[p] = p.grad
                            p.grad = None
                # The rest (large tensors, DTensors, AMSGrad groups): torchao's per-tensor step.
                rest = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
                if _traced(rest, self.param_groups):
                    self._state_alone(rest)
                    self.updated_alone = 0
                else:
                    self.updated_alone = len(rest)
                    super().step()
            finally:
                for p, grad in held.items():
                    p.grad = grad
        return loss

    def _state_alone(self, params: list[torch.Tensor]) -> None:
        """A memory trace's step of the tensors torchao updates one at a time: their state, made
        as torchao makes it, and the step count, without the update. torchao's compiled kernel
        updates a tensor in place and allocates nothing above its state (MemoryMeter on a real
        CPU step: within 200 B); run eagerly over fake tensors (it cannot be compiled over them)
        its float32 temporaries made the traced optimizer phase 2.6-2.8x the real step's."""
        for p in params:
            self._init_state(p)
            self.state[p]["step"].add_(1.0)

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        if len(state) == 0:  # as torchao initializes it (_AdamBase.step)
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(p, True)
            state["exp_avg_sq"] = self._new_buffer(p, False)

    def _update_bucket(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        if not isinstance(group["lr"], torch.Tensor):  # torchao's own check, same words
            raise RuntimeError("lr was changed to a non-Tensor object. If you want to update lr, please use "
                               "optim.param_groups[0]['lr'].fill_(new_lr)")
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1.0)
        sizes = [p.numel() for p in params]
        weights = [p.detach().view(-1) for p in params]
        exp_avgs = [s["exp_avg"].view(-1) for s in states]
        exp_avg_sqs = [s["exp_avg_sq"].view(-1) for s in states]
        flat_w = torch.cat(weights)
        flat_g = torch.cat([p.grad.view(-1) for p in params])  # type: ignore[union-attr]
        flat_m = torch.cat(exp_avgs)
        flat_v = torch.cat(exp_avg_sqs)
        if not isinstance(flat_w, FakeTensor):
            self._bucket_update(
                flat_w, flat_g, steps[0], flat_m, flat_v, None, group["lr"], group["betas"][0], group["betas"][1],
                group["weight_decay"], group["eps"], self.is_adamw,
                self.bf16_stochastic_round and flat_w.dtype is torch.bfloat16,
            )
        # Else a memory trace (fake tensors, memtrain.analysis.trace): the update cannot be compiled
        # over them, and run eagerly its FP32 temporaries of a whole bucket would stand for a kernel
        # that allocates nothing beyond the copies (MemoryMeter: under 1 KB above them), so the
        # copies alone are the step's memory and the values (fake) are not computed.
        torch._foreach_copy_(weights, list(flat_w.split(sizes)))
        torch._foreach_copy_(exp_avgs, list(flat_m.split(sizes)))
        torch._foreach_copy_(exp_avg_sqs, list(flat_v.split(sizes)))


def _traced(params: list[torch.Tensor], groups: list[dict[str, Any]]) -> bool:
    """Whether ``params`` (those torchao's per-tensor step would update) are a memory trace's fake
    tensors whose update :meth:`BucketedSRAdamW._state_alone` stands for (not AMSGrad's, whose
    extra state it does not make)."""
    return bool(params) and all(isinstance(p, FakeTensor) for p in params) and not any(g["amsgrad"] for g in groups)


def _bucketable(p: torch.Tensor) -> bool:
    """A tensor this optimizer updates in a bucket: a dense contiguous weight with a gradient of its
    own dtype, not a DTensor (see the module docstring for the size limit, applied in _buckets)."""
    grad = p.grad
    return (grad is not None and not grad.is_sparse and not isinstance(p, DTensor) and p.is_contiguous()
            and grad.is_contiguous() and grad.dtype == p.dtype)


def _buckets(params: list[torch.Tensor], state: Any) -> list[list[torch.Tensor]]:
    """The buckets of ``params`` (in order): tensors of one device, dtype and step count, planned by
    :func:`memtrain.techniques.facts.sr_adamw_buckets` (which the estimate reads too). A tensor in
    no bucket is left to torchao's per-tensor step."""
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        kinds.setdefault((p.device, p.dtype), []).append(p)
    out = []
    for members in kinds.values():
        # A bucket shares one step count, as torchao's update reads one; counts differ only where
        # a tensor had no gradient in some step.
        by_count: dict[float, list[torch.Tensor]] = {}
        for p, count in zip(members, _step_counts([state[p]["step"] for p in members])):
            by_count.setdefault(count, []).append(p)
        for alike in by_count.values():
            for indices in sr_adamw_buckets([p.numel() for p in alike]):
                out.append([alike[i] for i in indices])
    return out


def _step_counts(steps: list[torch.Tensor]) -> list[float]:
    """The step counts (torchao keeps each as a CPU scalar tensor), read in one call. A memory
    trace runs the step over fake tensors, which hold no value: their counts are taken as alike."""
    if any(isinstance(s, FakeTensor) for s in steps):
        return [0.0] * len(steps)
    return torch.stack(steps).tolist()
