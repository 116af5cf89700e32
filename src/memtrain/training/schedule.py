"""The learning-rate schedule as a pure function of the run config (no torch): the
training loop wraps it in a LambdaLR (:mod:`memtrain.training.step`), and the checks made
before a resumed run (:func:`memtrain.training.resume_check.continue_longer`) read it to say
what a longer ``--steps`` does to the LR."""

from __future__ import annotations

import math
from typing import Callable

from memtrain.config.run import RunConfig


def lr_lambda(cfg: RunConfig) -> Callable[[int], float]:
    """Linear warm-up to 1, then cosine or linear down to ``min_lr_ratio`` (or constant)."""
    t = cfg.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        decay_steps = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / decay_steps)
        if t.schedule == "linear":  # transformers' get_linear_schedule_with_warmup, floored at min_lr_ratio
            return t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 - progress)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
