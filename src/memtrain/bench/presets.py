"""Former home of the bench's technique sets and scales, kept so existing imports work:
:mod:`memtrain.bench.technique_sets` (rows) and :mod:`memtrain.bench.scales` (run settings)."""

from memtrain.bench.scales import SCALE_BUDGET, SCALE_MAX_BATCH, SCALE_WINDOW, SCALES, scale_overrides
from memtrain.bench.technique_sets import (
    DEFAULT_TECHNIQUES,
    DESCRIPTIONS,
    NOISE_ROW,
    NOISE_SUFFIX,
    TECHNIQUES,
    describe,
    is_noise_row,
    technique_overrides,
)

__all__ = ["SCALE_BUDGET", "SCALE_MAX_BATCH", "SCALE_WINDOW", "SCALES", "scale_overrides", "DEFAULT_TECHNIQUES",
           "DESCRIPTIONS", "NOISE_ROW", "NOISE_SUFFIX", "TECHNIQUES", "describe", "is_noise_row", "technique_overrides"]
