"""``--distributed deepspeed-zero2|deepspeed-zero3``: memtrain's options as a DeepSpeed
config, and the train step that drives DeepSpeed's engine."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from memtrain.config.run import RunConfig
from memtrain.data.loader import MicroBatches


def deepspeed_config(cfg: RunConfig, world_size: int) -> dict[str, Any]:
    """memtrain's options as a DeepSpeed config (ZeRO stage 2 or 3)."""
    t, tech = cfg.train, cfg.technique
    stage = 3 if tech.distributed == "deepspeed-zero3" else 2
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if tech.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": tech.precision == "bf16"},
        "fp16": {"enabled": tech.precision == "fp16"},
        "steps_per_print": 2**31 - 1,  # memtrain reports progress itself
        "wall_clock_breakdown": False,
    }


def deepspeed_train_step(engine: Any, micro_batches: list, optimizer: Any, precision: Any, grad_clip: float,
                         device: torch.device, meter: Any = None, no_sync: Any = None,
                         before_wait: Optional[Callable[[], None]] = None) -> float:
    """``train_step`` for a DeepSpeed engine: it scales by the accumulation steps, reduces,
    clips and steps the optimizer itself (on the last micro-batch). ``before_wait`` runs after
    the last micro-batch's step is queued, as in ``train_step``."""
    losses = []
    n = len(micro_batches)
    # --loss-on completion: each micro-batch's share of the step's answer tokens (the engine
    # divides by the accumulation steps itself, so the share is given times n).
    scales = micro_batches.loss_scales(device) if isinstance(micro_batches, MicroBatches) else None
    for i, (x, y) in enumerate(micro_batches):
        loss = engine(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        if scales is not None:
            loss = loss * (scales[i] * n)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    if before_wait is not None:
        before_wait()
    return sum(float(v) for v in losses) / n
