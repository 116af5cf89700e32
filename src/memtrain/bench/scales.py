"""Run scales of a bench: the settings shared by every row (model, batch, sequence, steps), so
rows differ only in technique (``memtrain bench --scale``)."""

from __future__ import annotations

from typing import Any

from memtrain.config.run import ConfigError

SCALES: dict[str, dict[str, Any]] = {
    # The published comparison's settings (RTX 4090): default model, batch 64, seq 256,
    # one 200-step epoch with 200 warm-up steps.
    "seed": {"batch_size": 64, "seq_len": 256, "steps": 200, "warmup_steps": 200, "val_blocks": 64},
    # Finishes on 2 CPU cores in minutes: the same default model (so the memory picture,
    # dominated by the 50257-token logits, is the real one) at one sequence of 256 tokens per step
    # for 40 steps, a short warm-up and a higher learning rate so the quality column means
    # something. The tokens per row are those of 4 x 128 x 20 steps, but twice the updates: at
    # 20 steps the baseline's PPL is still falling fast and two seeds differ widely; by step 40
    # it falls about half as fast (the measured PPL, with its machine: docs/performance.md,
    # the `quick` scale). Memory: batch 1 keeps the step cheap, and the
    # max-batch column shows the techniques (SCALE_BUDGET: 2 GiB; `memtrain maxbatch` predicts
    # 10 for the baseline, 11 with flash, 12 with checkpointing, 104 with the chunked loss,
    # 322 for the lowest-memory row), where 4 x 128 under 1 GiB gave 10-11 for every row but
    # the chunked loss's. Dropout is off because PyTorch's CPU flash kernel has no dropout (the
    # flash rows could not run on CPU).
    "quick": {"batch_size": 1, "seq_len": 256, "steps": 40, "warmup_steps": 5, "lr": 2e-3, "val_blocks": 16,
              "dropout": 0.0},
}

DEFAULT_SCALE = "quick"

# Per-scale adjustments of technique presets (the window must fit the sequence).
SCALE_WINDOW = {"seed": 128, "quick": 128}

# Memory budget for the max-batch column by scale when the device has no memory limit of
# its own (CPU): the search then runs against the tracked meter.
SCALE_BUDGET = {"seed": None, "quick": "2GiB"}
SCALE_MAX_BATCH = {"seed": 1024, "quick": 512}


def scale_overrides(scale: str) -> dict[str, Any]:
    """Config overrides of run scale ``scale`` (ConfigError naming the scales when unknown)."""
    if scale not in SCALES:
        raise ConfigError(f"unknown scale {scale!r} (--scale); choose {' or '.join(SCALES)}")
    return dict(SCALES[scale])
