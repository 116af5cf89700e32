"""Forward-only (inference) memory."""

from __future__ import annotations

from typing import Any, Optional

from memtrain.analysis.estimate.inventory import Dims, resolve_backend
from memtrain.analysis.estimate.params import head_widths, param_count
from memtrain.config.archs import GPT2_ARCH, Arch
from memtrain.config.run import ConfigError, RunConfig

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}


# --------------------------------------------------------------------------- inference
def estimate_inference(cfg: RunConfig, weights_dtype: str = "fp32", arch: Arch = GPT2_ARCH,
                       batch: Optional[int] = None) -> dict[str, Any]:
    """Forward-only memory: weights in ``weights_dtype`` plus one forward without autograd.

    Without grad nothing is saved, so the activations are transient: the residual stream, one
    block's largest intermediates (the attention scores and softmax for the math kernel, the MLP
    hidden) and, at the end, the logits of every position (b x s x V in the compute dtype).
    Compared with the rule of thumb "about 1.2 x the weights" (EleutherAI's Transformer Math 101).
    """
    if weights_dtype not in ("fp32", "bf16", "fp16", "int8"):
        raise ConfigError(f"--weights-dtype {weights_dtype!r}: choose fp32, bf16, fp16 or int8")
    m, t = cfg.model, cfg.train
    n_params = param_count(m, arch)[0]
    wb = DTYPE_BYTES[weights_dtype]
    weights = n_params * wb
    a = 4 if weights_dtype == "fp32" else 2  # int8 weights dequantize to 16-bit compute
    b, s, d, f, h = batch or t.batch_size, t.seq_len, m.d_model, m.d_ff, m.n_heads
    V = m.padded_vocab_size
    N = b * s
    # q and the attention's output are qw wide, k and v kv (Arch.head_dim: a transformers
    # config's head width where it is not d / n_heads).
    qw, kv = head_widths(m, arch)
    dm = Dims(b, s, d, f, h, kv, V, a, a, wb, autocast=False, dropout=False, cuda=False)
    backend = resolve_backend(cfg.technique.attention, cfg.technique.window, dm)
    x = N * d * a
    qkv = N * (qw + 2 * kv) * a
    if backend == "math":
        sc = b * h * s * s
        # q, k copies + scores + scaled + masked; then float32 softmax next to the masked scores.
        attn = qkv + 2 * N * qw * a + max(2 * sc * a, sc * a + 2 * sc * 4)
    elif backend.startswith("banded"):
        W = cfg.technique.window or s
        sc = b * h * s * (2 * W - 1)
        attn = qkv + 4 * N * qw * a + 2 * sc * 4
    else:
        attn = qkv + N * qw * a + b * h * s * 4
    mlp = N * f * a * (3 if arch.mlp == "swiglu" else 2) + N * d * a
    block_peak = x + max(attn, mlp)
    logits = N * V * a + N * d * a
    activations = max(block_peak, logits)
    peak = weights + activations
    rule = 1.2 * weights
    return {
        "mode": "inference",
        "parameters": n_params,
        "weights_dtype": weights_dtype,
        "bytes": {"weights": weights, "activations": block_peak, "logits": logits},
        "peak_bytes": peak,
        "peak_phase": "lm_head logits" if logits >= block_peak else f"block forward ({backend} attention)",
        "rule_of_thumb_bytes": rule,
        "ratio_to_weights": peak / weights,
        "rule_holds": peak <= rule,
        "explanation": [
            f"weights = {n_params:,} x {wb:g} B ({weights_dtype})",
            f"one block's forward (no autograd, transient): residual + qkv + "
            f"{'s^2 scores and fp32 softmax' if backend == 'math' else 'fused attention'} or the MLP hidden",
            f"logits = b*s*V*{a} B = {N:,} x {V:,} (every position, as model(x) returns them)",
            f"rule of thumb 1.2 x weights = {rule / 2**30:.2f} GiB; here {peak / weights:.2f} x weights"
            + ("" if peak <= rule else ": the rule breaks because batch*seq activations (logits above all) "
               "outgrow 20% of the weights"),
        ],
    }
