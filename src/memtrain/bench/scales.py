"""Run scales of a bench: the settings shared by every row (model, batch, sequence, steps), so
rows differ only in technique (``memtrain bench --scale``)."""

from __future__ import annotations

from typing import Any

from memtrain.config.layers import attention_default_of, merged_layers, normalized_layers, warmup_named
from memtrain.config.run import ConfigError, ModelConfig, capped_warmup

SCALES: dict[str, dict[str, Any]] = {
    # The published comparison's settings (RTX 4090): default model, batch 64, seq 256,
    # one 200-step epoch with 200 warm-up steps.
    "seed": {"batch_size": 64, "seq_len": 256, "steps": 200, "warmup_steps": 200, "val_blocks": 64},
    # Finishes on 2 CPU cores in minutes: the same default model (so the memory picture,
    # dominated by the 50257-token logits, is the real one) at one sequence of 256 tokens per step
    # for 40 steps, a short warm-up and a higher learning rate so the quality column means
    # something. Dropout is off because PyTorch's CPU flash kernel has no dropout.
    # Quality: the validation PPL is read on 64 blocks (16,384 tokens), not 16. The held-out
    # set's first blocks are a few documents on which two seeds' models differ far more than on
    # the rest, so on 16 blocks the seed-to-seed difference was larger than every row's; 64
    # blocks halve the spread of the PPL over seeds for 48 more forward passes per row (a few
    # seconds at batch 1), and more blocks shrink it little further. More steps or longer
    # sequences would cost training time per row, which the default list on 2 cores cannot spend;
    # sequence 512 (the model's longest) would not change the memory picture either, the logits
    # still dominating. The rows are judged against nudged twins (same seed, weights one rounding
    # apart: 1.9% here) rather than another seed (6.8%), the rows themselves sharing the seed
    # (memtrain.report.noise). Measured figures: docs/performance.md.
    "quick": {"batch_size": 1, "seq_len": 256, "steps": 40, "warmup_steps": 5, "lr": 2e-3, "val_blocks": 64,
              "dropout": 0.0},
}

DEFAULT_SCALE = "quick"

# Per-scale adjustments of technique presets (the window must fit the sequence).
SCALE_WINDOW = {"seed": 128, "quick": 128}

# Memory budget for the max-batch column by scale when the device has no memory limit of
# its own (CPU): the search then runs against the tracked meter (traced: nothing is allocated,
# so the budget need not fit the machine). A technique's saving is a share of the step's memory,
# nearly the same at any budget (flash attention ~9%, full checkpointing ~15% at sequence 256:
# the logits are most of the rest), so the budget sets how many batches that share is: under
# 2 GiB the baseline fits 10 and those savings read as 1-2 batches; under 5 GiB the estimator
# predicts 28 for the baseline, 31 with flash, 33 with checkpointing, 481 with the chunked loss and
# 1,288 for the lowest-memory row (Adafactor, the default list's CPU row), the smallest budget at
# which flash attention reads as 3 batches. Not more: a traced probe of the chunked loss steps
# through every 256-token chunk, so those rows' probes cost time in proportion to their batch.
# The search's cap is above the largest of them.
SCALE_BUDGET = {"seed": None, "quick": "5GiB"}
SCALE_MAX_BATCH = {"seed": 1024, "quick": 2048}


def scale_overrides(scale: str) -> dict[str, Any]:
    """Config overrides of run scale ``scale`` (ConfigError naming the scales when unknown)."""
    if scale not in SCALES:
        raise ConfigError(f"unknown scale {scale!r} (--scale); choose {' or '.join(SCALES)}")
    return dict(SCALES[scale])


def fitted_scale_overrides(scale: str, *later: dict[str, Any]) -> dict[str, Any]:
    """Config overrides of run scale ``scale`` below the ``later`` layers (a row's, a config
    file's, the flags): :func:`fitted_scale_layer` of those layers, their aliases read here."""
    return fitted_scale_layer(scale, normalized_layers(*later))


def fitted_scale_layer(scale: str, flat_layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Config overrides of run scale ``scale`` below ``flat_layers`` (the later layers as
    :func:`normalized_layers` returns them, so a caller that asks more of them reads them once):
    a scale warm-up longer than the --steps a later layer asks is replaced by train's default
    rule for a run length without a warm-up (:func:`capped_warmup`), since no one asked for the
    scale's warm-up and the rows would never reach --lr. A warm-up a later layer names is left as
    given (the bench refuses one longer than the run, as train does)."""
    layer = _fitted_seq_len(scale_overrides(scale), merged_layers(flat_layers))
    if warmup_named(flat_layers):
        return layer
    asked: Any = layer.get("steps")
    for flat in flat_layers:
        asked = flat.get("steps", asked)
    if isinstance(asked, bool):
        return layer
    try:  # a flag's value is still text here ("2"); build_config reports one that is no number
        steps = int(asked)
    except (TypeError, ValueError):
        return layer
    if 0 < steps < layer.get("warmup_steps", 0):
        layer["warmup_steps"] = capped_warmup(steps)
    return layer


def _fitted_seq_len(layer: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``layer`` with its sequence length cut to the positions of a ``--model`` shorter than it,
    when no later layer names one: the scale's length is a default, as train's is (build_config)."""
    spec = given.get("model")
    if "seq_len" in given or "seq_len" not in layer or not (isinstance(spec, str) or "max_seq_len" in given):
        return layer
    try:
        # our GPT (a preset or not) takes --max-seq-len, a flag's value still text here
        model = {"max_seq_len": int(given["max_seq_len"])} if "max_seq_len" in given else {}
        positions = ModelConfig.from_spec(spec if isinstance(spec, str) else None, **model).max_seq_len
    except (ConfigError, TypeError, ValueError):
        return layer  # build_config says what is wrong with the model, once
    if isinstance(positions, int) and 0 < positions < layer["seq_len"]:
        layer["seq_len"] = positions
    return layer


def row_base_layers(scale: str, flat_layers: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The layers every row of a comparison takes around its given settings ``flat_layers`` (as
    :func:`normalized_layers` returns them): the scale's layer fitted to them (below them), and
    the model's default attention where they name none (:func:`attention_default_of`; empty for
    memtrain's GPT). ``memtrain bench`` and compare_hf both take them here, so one row runs the
    same attention in either."""
    scale_layer = fitted_scale_layer(scale, flat_layers)
    # The scale's layer is flat and in memtrain's names already: nothing to normalize.
    return scale_layer, attention_default_of([scale_layer, *flat_layers])
