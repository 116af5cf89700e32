"""Size limits, checked before any arithmetic, allocation or search depends on a size.

A leaf module (it imports only the error type), below everything that counts or runs: the
config sections, the command-line types and the analytic commands (estimate, flops, plan) all
refuse an absurd size here, at once, with the same bound and the same words; so do the builders
(train, export, generate: memtrain.training.size_check.check_model_size) before a model is built. Without a bound a
typo such as ``--batch-size 10**30`` reaches torch (an overflow: exit 1), float arithmetic
(``inf``: exit 1) or a search that runs for minutes.
"""

from __future__ import annotations

from typing import Any

from memtrain.errors import ConfigError

__all__ = ["MAX_BATCH", "MAX_BYTES", "MAX_INT", "MAX_LAYERS", "MAX_PARAMS", "MAX_RANKS", "MAX_WIDTH", "MAX_WORLD_SIZE",
           "check_analytic_size", "check_at_most", "short_number"]

# Nothing near these has been trained (GPT-3: 96 layers, d_model 12288; PaLM: 118 layers, 18432;
# the largest vocabularies are ~256k): a size beyond them is a typo or a probe, and refusing it
# keeps every answer O(1) in time and memory (docs/estimation.md).
MAX_LAYERS = 100_000
MAX_WIDTH = 1 << 20  # d_model, d_ff, vocabulary (and its padding multiple), context length
MAX_PARAMS = 10**15
# Sequences in one micro-batch, micro-batches per step, a batch search's bound or step: 16M
# sequences of one token is already far beyond any device.
MAX_BATCH = 1 << 24
# A memory budget: 1 EiB, a million times today's largest accelerator.
MAX_BYTES = 1 << 60
# Ranks one launcher starts on one machine; ranks of a whole job (today's largest runs: ~10^5).
MAX_RANKS = 1024
MAX_WORLD_SIZE = 1 << 20
# Any integer memtrain hands to torch (sizes, seeds, counts) must fit its int64.
MAX_INT = 2**63 - 1


def short_number(value: int | float) -> str:
    """``123,456`` for a readable number, ``1.0e+30`` for a long one (also beyond float's range)."""
    if isinstance(value, int) and value < 10**24:
        return f"{value:,}"
    digits = str(int(value))
    return f"{digits[0]}.{digits[1:3] or '0'}e+{len(digits) - 1}"


def check_at_most(flag: str, value: int | float, limit: int, unit: str = "") -> None:
    """Refuse ``value`` above ``limit`` (ConfigError: exit 2), naming the flag and the bound."""
    if value > limit:
        raise ConfigError(f"{flag} {short_number(value)}{unit} is beyond what memtrain builds or estimates "
                          f"(at most {limit:,}{unit}); give a real size")


def check_analytic_size(m: Any) -> None:  # a memtrain.config.run.ModelConfig (config imports this module)
    """Refuse absurd model sizes (ConfigError: exit 2) before any arithmetic depends on them."""
    check_at_most("--n-layers", m.n_layers, MAX_LAYERS)
    for name in ("d_model", "n_heads", "d_ff", "vocab_size", "vocab_multiple", "max_seq_len"):
        check_at_most(f"--{name.replace('_', '-')}", getattr(m, name), MAX_WIDTH)
