"""The analytic memory model of transformers decoders memtrain models (Llama, Qwen2, Mistral).

The analytic estimator (memtrain.analysis.estimate) simulates one step op by op from an inventory of
what each op allocates and saves for backward. Its block inventory is our GPT's; a Llama-style
transformers decoder layer differs from it in three ways that matter for memory, written here
and switched on by ``Arch.hf``:

* ``LlamaRMSNorm`` (and Qwen2's, Mistral's) computes in float32: ``x.to(float32)`` is kept for
  backward (a new tensor unless the residual stream is float32), so is the normalized tensor
  cast back to the input dtype (which the weight multiplies), next to the output and the
  per-token rstd.
* Rotary embeddings (``q * cos + rotate_half(q) * sin``, same for k) make new q and k tensors;
  SDPA saves those (not the projections), and the forward passes through a few q-sized copies.
* peft creates the LoRA adapters in the base weights' dtype (bf16 under ``--precision
  bf16-pure``), where memtrain's own LoRA keeps them in float32; and a frozen LM head gets no
  gradient from the chunked loss.

Everything else (separate q/k/v projections = one fused one for memory, SwiGLU's gate/up/down
saves = memtrain's fused SwiGLU, SDPA/eager attention, checkpointing, the loss) is the
estimator's own inventory. Families not listed in :data:`MODELLED` (Gemma: float32 norm output
and scaled embeddings; Phi-3: fused projections with chunk; GPT-2: Conv1D, gelu_new, attention
dropout) and QLoRA (torchao's NF4 dequantization scratch) are not modelled: ``estimate`` traces
them and says so.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from memtrain.archs import LLAMA_ARCH, Arch

__all__ = ["MODELLED", "hf_arch", "why_not_modelled", "analytic_estimate", "hf_norm_node", "hf_rope_node"]

# model_type -> the layer code is Llama's (modeling_qwen2/modeling_mistral copy it)
MODELLED = ("llama", "qwen2", "mistral")


def why_not_modelled(cfg: Any) -> Optional[str]:
    """None when the analytic model covers ``cfg`` (a RunConfig of a transformers model), else
    the reason it does not (the estimate then traces)."""
    from memtrain.models.hf import GPT_LORA_TARGETS
    from memtrain.models.spec import load_config

    c = load_config(cfg.model.model)
    tech = cfg.technique
    if c.model_type not in MODELLED:
        return f"no analytic model of {c.model_type} layers (only {', '.join(MODELLED)})"
    if tech.qlora:
        return "QLoRA's NF4 weights and their dequantization scratch are not modelled analytically"
    if tech.lora_rank and tech.lora_targets not in (GPT_LORA_TARGETS, "all-linear"):
        return "named --lora-targets are not modelled analytically (only every decoder Linear)"
    if tech.window is not None or getattr(c, "use_sliding_window", False):
        return "sliding-window attention is not modelled analytically for transformers models"
    head_dim = getattr(c, "head_dim", None)
    if head_dim is not None and head_dim * c.num_attention_heads != c.hidden_size:
        return "a head_dim other than hidden_size / heads is not modelled analytically"
    if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
        return "biased projections are not modelled analytically"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"hidden_act {c.hidden_act} is not modelled analytically (SiLU only)"
    return None


def hf_arch(spec: str) -> Arch:
    """The :class:`Arch` of a modelled transformers config (Llama-style layers, its k/v heads)."""
    from memtrain.models.spec import load_config

    c = load_config(spec)
    return replace(LLAMA_ARCH, name=c.model_type, n_kv_heads=getattr(c, "num_key_value_heads", None), hf=True)


def analytic_estimate(cfg: Any, device_type: str) -> Optional[Any]:
    """memtrain.analysis.estimate.estimate of ``cfg`` with the transformers inventory, or None when the
    family or technique is not modelled (see :func:`why_not_modelled`)."""
    if why_not_modelled(cfg) is not None:
        return None
    from memtrain.analysis.estimate import estimate

    return estimate(cfg, hf_arch(cfg.model.model), device_type)


def hf_norm_node(dm: Any, name: str, src: str, out: str, trainable: bool) -> Any:
    """LlamaRMSNorm: ``w * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(dtype)``. Saved:
    the float32 input (``src`` itself when the stream is float32), rstd, and (for a trainable
    weight) the normalized tensor in the stream's dtype; the output is read by the projections
    (saved by them)."""
    from memtrain.analysis.estimate.simulator import _Node

    N, d, r = dm.n, dm.d, dm.r
    x32 = src if r == 4 else f"{name}.x32"
    outs: list[tuple] = [(out, N * d * r), (f"{name}.stats", N * 4), (f"{name}.nrm", N * d * r)]
    if r != 4:
        outs.append((x32, N * d * 4))
    # The weight multiply keeps the normalized tensor only for the weight's gradient: not when
    # the norm is frozen (LoRA).
    saves = [x32, f"{name}.stats"] + ([f"{name}.nrm"] if trainable else [])
    return _Node(name, out=outs, inputs=[src], saves=saves, grad_out=(out,),
                 grads=[(src, N * d * r)] + ([(f"param:{name}.weight", 0.0)] if trainable else []),
                 # pow's output, and the float32 normalized tensor before its cast back
                 fwd_scratch=N * d * 4 * (2 if r != 4 else 1),
                 # backward: the float32 gradient through the cast, mul and pow
                 scratch=2 * N * d * 4)


def hf_rope_node(dm: Any, qkv: str, out: str) -> Any:
    """apply_rotary_pos_emb: new q and k (``q * cos + rotate_half(q) * sin``); v passes on. For
    memory the q/k/v triple stays one storage (what SDPA saves); the forward's scratch is the
    products and the ``cat`` of rotate_half."""
    from memtrain.analysis.estimate.simulator import _Node

    N, d, kv, a = dm.n, dm.d, dm.kv, dm.a
    return _Node(f"{out}.rope", out=[(out, N * (d + 2 * kv) * a)], inputs=[qkv],
                 grads=[(qkv, N * (d + 2 * kv) * a)], fwd_scratch=3 * N * (d + kv) * a,
                 scratch=2 * N * (d + kv) * a)
