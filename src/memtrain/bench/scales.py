"""Run scales of a bench: the settings shared by every row (model, batch, sequence, steps), so
rows differ only in technique (``memtrain bench --scale``; ``--preset`` is its former name)."""

from __future__ import annotations

from typing import Any

from memtrain.config import ConfigError

SCALES: dict[str, dict[str, Any]] = {
    # The published comparison's settings (RTX 4090): default model, batch 64, seq 256,
    # one 200-step epoch with 200 warm-up steps.
    "seed": {"batch_size": 64, "seq_len": 256, "steps": 200, "warmup_steps": 200, "val_blocks": 64},
    # Finishes on 2 CPU cores in minutes: the same default model (so the memory picture,
    # dominated by the 50257-token logits, is the real one) at a smaller batch and sequence,
    # fewer steps, a short warm-up and a higher learning rate so the quality column means
    # something: 20 steps at lr 2e-3 reach val PPL ~1,580 on the FP32 baseline (20 at 3e-4
    # stopped at ~11,084, every row alike; 30 at 1e-3 reached ~1,380 but a row then took ~50 s on
    # a 2-core AVX2 CPU, too long for 8 rows in 5 minutes; docs/performance.md). Dropout is off
    # because PyTorch's CPU flash kernel has no dropout (the flash rows could not run on CPU).
    "quick": {"batch_size": 4, "seq_len": 128, "steps": 20, "warmup_steps": 5, "lr": 2e-3, "val_blocks": 16,
              "dropout": 0.0},
}

DEFAULT_SCALE = "quick"

# Per-scale adjustments of technique presets (the window must fit the sequence).
SCALE_WINDOW = {"seed": 128, "quick": 64}

# Memory budget for the max-batch column by scale when the device has no memory limit of
# its own (CPU): the search then runs against the tracked meter.
SCALE_BUDGET = {"seed": None, "quick": "1GiB"}
SCALE_MAX_BATCH = {"seed": 1024, "quick": 256}


def scale_overrides(scale: str) -> dict[str, Any]:
    """Config overrides of run scale ``scale`` (ConfigError naming the scales when unknown)."""
    if scale not in SCALES:
        raise ConfigError(f"unknown scale {scale!r} (--scale, alias --preset); choose {' or '.join(SCALES)}")
    return dict(SCALES[scale])
