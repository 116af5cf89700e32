"""FLOP arithmetic for a training step.

The rule of thumb (Kaplan et al. 2020; PaLM appendix B): a training step costs
6 FLOPs per parameter per token (2 forward, 4 backward) for the matmuls against weights,
plus the attention matmuls QK^T and AV, which have no parameters:
2 matmuls x 2 FLOPs x seq x d_model per token per layer forward, x3 with backward
= 12 * n_layers * d_model * seq per token. The position embedding is a lookup (no FLOPs),
so it is left out of the parameter term; the tied token embedding is counted once, for
the LM-head matmul. Causal masking does not halve the count: the math and SDPA kernels
compute the full score matrix.
"""

from __future__ import annotations

from memtrain.config import ModelConfig


def rule_flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int) -> float:
    """Training FLOPs per token by the 6N + attention rule."""
    matmul_params = n_params - cfg.max_seq_len * cfg.d_model  # drop the position lookup table
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len
