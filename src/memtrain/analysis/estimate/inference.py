"""Inference memory: ``memtrain generate`` (prefill, KV cache, decode) or one forward without autograd."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from memtrain.analysis.estimate.attention_nodes import resolve_backend
from memtrain.analysis.estimate.dims import Dims
from memtrain.analysis.estimate.generation import DTYPE_BYTES, GENERATE_DTYPES, estimate_generate
from memtrain.analysis.estimate.hf import config_sliding_layers, config_window, hf_arch, why_generate_not_modelled
from memtrain.analysis.estimate.params import head_widths, param_count
from memtrain.config.archs import GPT2_ARCH, Arch
from memtrain.config.run import ConfigError, RunConfig
from memtrain.models.light_config import analytic_config
from memtrain.models.spec import config_positions, is_hf

__all__ = ["DTYPE_BYTES", "estimate_inference", "estimate_generate_run", "generate_positions"]


# --------------------------------------------------------------------------- inference
def estimate_inference(cfg: RunConfig, weights_dtype: str = "fp32", arch: Arch = GPT2_ARCH,
                       batch: Optional[int] = None, new_tokens: int = 0, sampling: bool = True) -> dict[str, Any]:
    """Inference memory, weights in ``weights_dtype``. ``new_tokens`` > 0: ``memtrain generate``
    sampling that many tokens after a ``--seq-len`` prompt for each of ``--batch-size`` sequences
    (:func:`estimate_generate_run`); 0: one forward of memtrain's GPT without autograd, below.

    Without grad nothing is saved, so the activations are transient: the residual stream, one
    block's largest intermediates (the attention scores and softmax for the math kernel, the MLP
    hidden) and, at the end, the logits of every position (b x s x V in the compute dtype).
    Compared with the rule of thumb "about 1.2 x the weights" (EleutherAI's Transformer Math 101).
    """
    if new_tokens:
        return estimate_generate_run(cfg, weights_dtype, None if is_hf(cfg) else arch, new_tokens, batch, sampling)
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


def _cache_line(res: dict[str, Any], n_layers: int, window: Optional[int]) -> str:
    """The explanation's KV cache line: its bytes as a product (full and sliding layers apart)."""
    head = f"KV cache (DynamicCache) = 2 x {res['batch']} sequences x {res['kv_width']} (kv heads x head dim) x "
    tail = f" x {res['compute_bytes']} B = {res['bytes']['kv_cache']:,} B"
    written, stored, sliding = res["cache_positions"], res["cache_stored_positions"], res["sliding_layers"]
    if window is None:
        return (f"{head}{n_layers} layers x {written} positions (prompt + new tokens - 1: the last token is never fed "
                f"back){tail}")
    full = n_layers - sliding
    layers = f"({sliding} sliding layers x {stored} + {full} full-attention layers x {written})" if full else \
        f"{n_layers} layers x {stored}"
    return (f"{head}{layers} positions{tail} (sliding_window {window}: a sliding layer stores at most {window} of the "
            f"{written} positions written, the prompt's until the first decode step)")


def generate_positions(cfg: RunConfig) -> Optional[int]:
    """The most positions (prompt + new tokens) ``memtrain generate`` takes for ``cfg``'s model:
    a transformers config's (None where it sets none), memtrain's GPT's ``--max-seq-len`` where
    given, else None (its position table is made as long as the run)."""
    if is_hf(cfg):
        assert cfg.model.model is not None  # is_hf: a transformers model is named
        return config_positions(analytic_config(cfg.model.model))
    return cfg.model.max_seq_len if "max_seq_len" in (getattr(cfg, "given_settings", None) or ()) else None


def estimate_generate_run(cfg: RunConfig, weights_dtype: str, arch: Optional[Arch], new_tokens: int,
                          batch: Optional[int] = None, sampling: bool = True) -> dict[str, Any]:
    """``memtrain generate``'s memory for ``cfg`` (:mod:`memtrain.analysis.estimate.generation`):
    a transformers model of a modelled family (``arch`` None: its
    :func:`~memtrain.analysis.estimate.hf.hf_arch`), or memtrain's GPT (``arch``: the preset's),
    which generate runs as a GPT2LMHeadModel (real vocabulary, biases, ``gelu_pytorch_tanh``).
    ConfigError, naming what would be needed, where it is not modelled, and where the prompt and
    new tokens exceed the model's positions (memtrain generate refuses that run too); memtrain's
    GPT without a --max-seq-len takes a position table of that length."""
    if weights_dtype not in GENERATE_DTYPES:
        raise ConfigError(f"--weights-dtype {weights_dtype} is not modelled for generate (a transformers model "
                          f"loads float weights): choose {', '.join(GENERATE_DTYPES)}"
                          + ("" if is_hf(cfg) else ", or --new-tokens 0 for one forward of memtrain's GPT"))
    t = cfg.train
    m = cfg.model
    total = t.seq_len + new_tokens
    window, sliding = None, None
    limit = generate_positions(cfg)
    if is_hf(cfg):
        assert m.model is not None  # is_hf: a transformers model is named
        c = analytic_config(m.model)
        reason = why_generate_not_modelled(c)
        if reason is not None:
            raise ConfigError(f"--mode inference: {reason}")
        arch = hf_arch(m.model)
        window = config_window(c)
        sliding = config_sliding_layers(c) if window is not None else None
    elif limit is None and total > m.max_seq_len:
        m = replace(m, max_seq_len=total)  # a position table as long as the run, as --seq-len alone derives one
    if limit is not None and total > limit:
        raise ConfigError(f"--seq-len {t.seq_len} + --new-tokens {new_tokens} exceeds the model's {limit} positions "
                          "(memtrain generate refuses it); shorten one")
    assert arch is not None
    if not arch.hf and arch.name == "gpt2":
        # memtrain.inference.export.hf_config: the real vocabulary (no padding rows) and biases always.
        m = replace(m, vocab_multiple=1, bias=True)
    res = estimate_generate(m, arch, batch or t.batch_size, t.seq_len, new_tokens, weights_dtype, sampling, window,
                            sliding)
    weights = res["bytes"]["weights"]
    rule = 1.2 * weights
    b, kv = res["bytes"], res["kv_cache_at_peak"]
    res.update({
        "mode": "inference",
        "generate": True,
        "rule_of_thumb_bytes": rule,
        "ratio_to_weights": res["peak_bytes"] / weights,
        "rule_holds": res["peak_bytes"] <= rule,
        "explanation": [
            f"weights = {res['parameters']:,} x {DTYPE_BYTES[weights_dtype]:g} B ({weights_dtype}), compute in the same dtype",
            _cache_line(res, m.n_layers, window),
            f"peak in {res['peak_phase']}: the cache then holds {kv:,} B, the rest ({b['activations']:,} B) is "
            "transient: the prefill's layer intermediates over batch x prompt tokens, or a decode step's "
            "old-beside-new cache tensor, the last position's logits and the sampling head's float32 (batch, vocab) "
            "tensors, token ids",
            f"rule of thumb 1.2 x weights = {rule / 2**30:.2f} GiB; here {res['peak_bytes'] / weights:.2f} x weights",
        ],
    })
    return res
