"""Size limits of a model, checked before any arithmetic or any build depends on a size.

A module of its own, below everything that counts (estimate, flops, plan) or builds (train,
export, generate: memtrain.preflight.check_model_size), so that each of them can refuse an
absurd size without importing the others.
"""

from __future__ import annotations

from memtrain.config import ConfigError, ModelConfig

__all__ = ["MAX_LAYERS", "MAX_PARAMS", "MAX_WIDTH", "check_analytic_size"]

# Limits of the analytic commands (estimate, plan, flops). Nothing near them has been trained
# (GPT-3: 96 layers, d_model 12288; PaLM: 118 layers, 18432): a size beyond them is a typo or a
# probe, and refusing it keeps every answer O(1) in time and memory (docs/estimation.md).
MAX_LAYERS = 100_000
MAX_WIDTH = 1 << 20  # d_model, d_ff, vocabulary, context length
MAX_PARAMS = 10**15


def check_analytic_size(m: ModelConfig) -> None:
    """Refuse absurd model sizes (ConfigError: exit 2) before any arithmetic depends on them."""
    if m.n_layers > MAX_LAYERS:
        raise ConfigError(f"--n-layers {m.n_layers:,} is beyond what memtrain builds or estimates "
                          f"(at most {MAX_LAYERS:,}); give a real depth")
    for name in ("d_model", "d_ff", "vocab_size", "max_seq_len"):
        v = getattr(m, name)
        if v > MAX_WIDTH:
            raise ConfigError(f"--{name.replace('_', '-')} {v:,} is beyond what memtrain builds or estimates "
                              f"(at most {MAX_WIDTH:,}); give a real size")
