"""The distributed wrap of the finished model: DDP (ddp, zero1), FSDP2 ``fully_shard``
(zero2, fsdp), and the ZeRO-1 optimizer glue; the last technique of the documented order."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from memtrain.config.run import ConfigError, TechniqueConfig
from memtrain.distributed.validation import LAUNCH_HINT
from memtrain.distributed.zero1 import ShardedZeRO1


def apply_distributed(model: nn.Module, tech: TechniqueConfig, device: torch.device, precision: Any) -> nn.Module:
    """Wrap (DDP) or shard (FSDP2) the finished model as ``tech.distributed`` says; last
    technique of :func:`memtrain.techniques.prepare_model`. Needs the process group."""
    s = tech.distributed
    if s == "none":
        if tech.cpu_offload:
            raise ConfigError("--cpu-offload needs sharded training: add --distributed zero2 or fsdp (under torchrun)")
        return model
    if not dist.is_initialized():
        raise ConfigError(f"--distributed {s} needs a process group; {LAUNCH_HINT.format(s=s)}")
    if s in ("ddp", "zero1"):
        # gradient_as_bucket_view: gradients live in DDP's communication buckets instead of
        # beside them, so DDP costs one gradient copy, not two.
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
        )
    if s in ("zero2", "fsdp"):
        return _fully_shard(model, tech, device, precision, reshard_after_forward=(s == "fsdp"))
    return model  # DeepSpeed wraps model and optimizer together, in DistContext.wrap_optimizer


def _fully_shard(model: nn.Module, tech: TechniqueConfig, device: torch.device, precision: Any,
                 reshard_after_forward: bool) -> nn.Module:
    """FSDP2: one parameter group per Transformer block, then the root (embeddings, final
    LayerNorm, tied LM head). Sharded bottom-up, as ``fully_shard`` requires."""

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if getattr(precision, "autocast_dtype", None) == torch.bfloat16:
        # Gather BF16 weights (half the all-gather bytes and the gathered copy), but reduce
        # gradients in FP32 so the sum over ranks loses nothing.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if tech.cpu_offload else OffloadPolicy()
    kw = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=offload)
    for block in model.blocks:  # type: ignore[union-attr]  # torch types nn.Module attributes as Tensor | Module
        fully_shard(block, **kw)  # type: ignore[call-overload]  # the policies dict matches fully_shard's keywords
    fully_shard(model, **kw)  # type: ignore[call-overload]  # the policies dict matches fully_shard's keywords
    return model


@contextlib.contextmanager
def fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2's equivalent of DDP's ``no_sync``: accumulate unreduced gradients locally."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]  # torch types nn.Module attributes as Tensor | Module
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]  # torch types nn.Module attributes as Tensor | Module


def _constructor_kwargs(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its constructor accepts (to build it again per shard)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in params}


def zero_redundancy(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeRO-1: the same optimizer class and parameter groups, each rank keeping the state of
    its dim-0 chunk of every parameter and broadcasting its updated rows after each step
    (:class:`memtrain.distributed.zero1.ShardedZeRO1`; torch's ZeroRedundancyOptimizer gives
    whole tensors to ranks, which leaves a large tied embedding's state on one rank)."""

    groups = [dict(g) for g in optimizer.param_groups]
    return ShardedZeRO1(groups, optimizer_class=type(optimizer), **_constructor_kwargs(optimizer))
