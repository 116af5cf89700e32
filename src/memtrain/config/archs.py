"""Architecture facts beyond ModelConfig: the families the analytic estimator models.

A leaf module (it imports nothing of memtrain), so that presets and model-spec resolution can
name an architecture without importing the estimator, which sits above the config layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Arch", "GPT2_ARCH", "LLAMA_ARCH"]


@dataclass(frozen=True)
class Arch:
    """Architecture facts beyond :class:`ModelConfig` (which describes our GPT-2-style model).

    Our trainer builds only ``gpt2`` (LayerNorm, GELU MLP, learned positions, biases per
    ``ModelConfig.bias``). ``llama`` (RMSNorm, SwiGLU MLP with three matrices, rotary positions,
    no biases, optional grouped-query attention) lets presets such as llama-7b be estimated with
    their real parameter count; their activation inventory is our GPT's with those substitutions,
    an approximation that no run here can check (see docs/estimation.md).
    """

    name: str = "gpt2"
    # gelu: fc -> gelu -> fc_out; swiglu: (silu(gate) * up) -> down; gelu_new: fc -> GELU's tanh
    # formula in Python ops (transformers' NewGELUActivation: GPT-2) -> fc_out
    mlp: str = "gelu"
    norm: str = "layernorm"  # layernorm (weight + bias) | rmsnorm (weight only)
    positional: str = "learned"  # learned (wpe table) | rope (no parameters)
    n_kv_heads: Optional[int] = None  # grouped-query attention; None = n_heads
    # A transformers decoder (Llama, Qwen2, Mistral, Phi-3, Gemma, GPT-2: memtrain.analysis.estimate.hf): RMSNorm that
    # upcasts to float32 and keeps the upcast and the normalized copy for backward, rotary
    # embeddings that copy q and k (GPT-2: neither), peft adapters in the parameter dtype.
    hf: bool = False
    # q/k/v projections with a bias (Qwen2's layers; Llama's and Gemma's with attention_bias).
    qkv_bias: bool = False
    # The attention's output projection with a bias (Llama's and Gemma's with attention_bias).
    proj_bias: bool = False
    # gate/up/down with a bias (Llama's with mlp_bias).
    mlp_bias: bool = False
    # The width of one attention head where it is not d_model / n_heads (Gemma-7B: 256 for 3072 /
    # 16): q and the attention's output are n_heads x head_dim wide, k and v n_kv_heads x head_dim.
    head_dim: Optional[int] = None
    # q/k/v as one Linear and gate/up as one Linear, split by slicing (Phi-3's qkv_proj and
    # gate_up_proj): one LoRA pair each, and the splits are views of the fused output.
    fused_proj: bool = False
    # Gemma's RMSNorm: ``(x.float() * rstd) * (1 + w.float())`` in float32, cast back at the end
    # (the normalized tensor kept for the weight's gradient is float32).
    norm_offset: bool = False
    # Gemma's embedding output multiplied by sqrt(hidden): a new tensor in the table's dtype.
    embed_scale: bool = False
    # transformers' GPT-2 layers (GPT2LMHeadModel): c_attn is q/k/v as one Conv1D (one LoRA pair),
    # split into views of its output as our GPT's fused qkv is (no rotary copies); the causal mask
    # is a float tensor added to the scores, the eager softmax runs in the scores' dtype, and the
    # modules' locals hold tensors until they return (memtrain.analysis.estimate.hf).
    gpt2_layers: bool = False
    # A transformers config's sliding window on every decoder layer (Mistral's sliding_window,
    # Qwen2's with use_sliding_window from layer 0 on), or None: from a sequence this long on,
    # transformers builds the windowed mask (``--window`` stands in for it: RunConfig.technique).
    sliding_window: Optional[int] = None
    # Qwen2's model makes the full causal mask beside the windowed one whenever one of its layers
    # slides (Qwen2Model.has_sliding_layers) and hands each layer its kind's; Mistral's and Phi-3's
    # make the windowed one alone. Eager attention materializes both.
    full_mask_beside_window: bool = False
    # Which decoder layers slide where some attend in full (Qwen2's from max_window_layers on, in
    # config.json's layer_types), in layer order; () where all or none do. A layer is handed its
    # kind's mask, so a checkpointed one keeps that mask until its backward.
    layer_slides: tuple[bool, ...] = ()


GPT2_ARCH = Arch()
LLAMA_ARCH = Arch(name="llama", mlp="swiglu", norm="rmsnorm", positional="rope")
