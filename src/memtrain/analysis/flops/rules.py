"""FLOP and byte rules: the 6N + attention rule of thumb, the optimizer update and clipping."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memtrain.config import ModelConfig

if TYPE_CHECKING:  # torch stays out of import time for ``memtrain --help``
    pass


def rule_flops_per_token(cfg: ModelConfig, seq_len: int, n_params: int) -> float:
    """Training FLOPs per token by the 6N + attention rule."""
    matmul_params = n_params - cfg.max_seq_len * cfg.d_model  # drop the position lookup table
    return 6.0 * matmul_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len


# Optimizer update FLOPs per trainable parameter, counted from torch's single-tensor update
# (torch/optim/adam.py, decoupled weight decay), a transcendental counted as one FLOP:
#   AdamW: p *= 1 - lr*wd (1); m.lerp_(g, 1-b1) (3); v = b2*v + (1-b2)*g*g (4);
#          denom = sqrt(v)/bc2 + eps (3); p -= step * m / denom (3)        = 14
# (the often quoted "~12" drops the decay and bias corrections; the difference is 2 FLOPs
# per parameter, about 0.01% of the default step). The low-bit AdamW variants do the same
# arithmetic on dequantized values (their (de)quantization is not counted).
#   SGD with momentum and weight decay: g += wd*p (2); buf = mu*buf + g (2); p -= lr*buf (2).
#   Adafactor: factored second moment (row/col means of g^2, their outer product), RMS
#   clipping and the update: about 12 (approximate).
OPTIMIZER_FLOPS_PER_PARAM: dict[str, float] = {
    "adamw": 14, "adamw-fused": 14, "adamw-foreach": 14, "adamw-8bit": 14, "adamw-4bit": 14,
    "adamw-bnb-8bit": 14, "sgd": 6, "adafactor": 12,
}
# Gradient clipping by global norm: square and accumulate (2), scale (1) per gradient element.
CLIP_FLOPS_PER_PARAM = 3
# Bytes of optimizer state per parameter per state tensor, and number of state tensors.
_OPTIMIZER_STATE: dict[str, tuple[int, float]] = {
    "adamw": (2, 4), "adamw-fused": (2, 4), "adamw-foreach": (2, 4),
    "adamw-8bit": (2, 1), "adamw-bnb-8bit": (2, 1), "adamw-4bit": (2, 0.5),
    "sgd": (1, 4), "adafactor": (0, 0),  # Adafactor's factored state is O(rows + cols)
}


def optimizer_bytes_per_param(optim: str, param_bytes: int, grad_clip: bool) -> float:
    """Minimum memory traffic of one update per parameter, as a fused kernel does it: read the
    weight, its gradient and each state tensor, write the weight and each state tensor back
    (the eager single-tensor loop moves several times this). Clipping reads the gradients
    twice (norm, then scale) and writes them once."""
    n_states, state_bytes = _OPTIMIZER_STATE.get(optim, (2, 4))
    if optim not in ("adamw-8bit", "adamw-bnb-8bit", "adamw-4bit") and param_bytes < 4:
        state_bytes = param_bytes  # torch keeps the state in the weight's dtype (bf16-pure)
    update = 2 * param_bytes + param_bytes + 2 * n_states * state_bytes
    return update + (3 * param_bytes if grad_clip else 0)
