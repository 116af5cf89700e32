"""The analytic memory model of transformers decoders memtrain models (Llama, Qwen2, Mistral, Phi-3,
Gemma, GPT-2).

The analytic estimator (memtrain.analysis.estimate) simulates one step op by op from an inventory of
what each op allocates and saves for backward. Its block inventory is our GPT's; a Llama-style
transformers decoder layer differs from it in three ways that matter for memory, switched on by
``Arch.hf`` (the nodes: :mod:`memtrain.analysis.estimate.hf_nodes`):

* ``LlamaRMSNorm`` (and Qwen2's, Mistral's) computes in float32: ``x.to(float32)`` is kept for
  backward (a new tensor unless the residual stream is float32), so is the normalized tensor
  cast back to the input dtype (which the weight multiplies), next to the output and the
  per-token rstd.
* Rotary embeddings (``q * cos + rotate_half(q) * sin``, same for k) make new q and k tensors;
  SDPA saves those (not the projections), and the forward passes through a few q-sized copies.
* peft creates the LoRA adapters in the base weights' dtype (bf16 under ``--precision
  bf16-pure``), where memtrain's own LoRA keeps them in float32; and a frozen LM head gets no
  gradient from the chunked loss. Under LoRA autograd records what the frozen parts need and no
  more (the first layer's norm and q/k/v, the LM head), peft's casts and autocast's adapter copies
  are counted, and q/k/v and gate/up run one Linear at a time (``linear_nodes._peft_lora``).
* Checkpointed layers recompute lazily, as torch's non-reentrant checkpoint does
  (``Segment.lazy_recompute``).
* Phi-3 (``Arch.fused_proj``) runs q/k/v and gate/up as one Linear each (one LoRA pair each)
  and slices them: v stays a view of the fused output, which SDPA's save keeps whole; rope ends
  in a ``cat`` that makes q contiguous as (b, h, s, hd), so SDPA's output is too, and the
  transpose's ``.contiguous()`` copies it.
* Gemma (``Arch.norm_offset``, ``Arch.embed_scale``): its RMSNorm multiplies by ``1 + w`` in
  float32 and casts back at the end (the normalized tensor the weight's gradient keeps is
  float32, and so is the ``1 + w`` the input's gradient keeps), the embedding's output is scaled by sqrt(hidden) into a new tensor, and its
  tanh-GELU gate is SiLU's for memory (one kernel each way, saving its input). Its head is
  tied (the estimator's tied weight).
* A head_dim other than hidden / heads (Gemma-7B, Mistral-Nemo: ``Arch.head_dim``) makes q, the
  attention's output and the output projection's input heads x head_dim wide. Biases follow each
  family's layer code: Qwen2's q/k/v always, Llama's and Gemma's q/k/v/o with ``attention_bias``,
  Llama's gate/up/down with ``mlp_bias`` (``Arch.qkv_bias``, ``proj_bias``, ``mlp_bias``; Mistral
  and Phi-3 have none whatever the config says).
* Named ``--lora-targets`` (peft's Llama default ``q_proj,v_proj``, MLP-only ones):
  :func:`~memtrain.analysis.estimate.params.lora_adapted` gives each named Linear its pair; in
  the first layer only what an adapter feeds requires a gradient, so autograd records nothing
  before it (:func:`~memtrain.analysis.estimate.block_nodes.grad_flow`), and a frozen Linear there
  keeps no weight copy. GPT-2's ``c_proj`` names two Conv1Ds, the attention's output and the MLP's
  down projection: peft adapts both.
* The CPU RNG state non-reentrant checkpoint stores per layer is not counted: it is made
  outside the dispatcher, so the memory meter never sees it.
* GPT-2 (``GPT2LMHeadModel``) is our GPT's inventory (LayerNorm, learned positions, biases, one
  fused q/k/v projection whose q, k, v are views: no RMSNorm upcast, no rotary copies) with
  transformers' differences. Its Conv1D (``addmm`` with an (in, out) weight, a bias always) is a
  Linear for memory; ``c_attn`` is one Conv1D, so peft gives it one LoRA pair (``Arch.gpt2_layers``;
  peft's ``all-linear`` wraps c_attn, c_proj, c_fc and the MLP's c_proj). ``gelu_new`` is
  NewGELUActivation's Python formula (``Arch.mlp == "gelu_new"``): pow saves its input, tanh its
  output, the last product ``0.5 * x`` and ``1 + tanh``, three (N, d_ff) tensors per layer beyond
  a fused GELU's (:func:`~memtrain.analysis.estimate.hf_nodes.gelu_new_nodes`). Eager attention
  adds the float causal mask GPT2Model builds once (``Dims.additive_mask``: nothing saved per
  layer) and runs its softmax in the scores' dtype (float32 under autocast only:
  ``Dims.softmax_fp32``); attention dropout (``attn_pdrop``) sends SDPA on the CPU to its float32
  math path, which adds a float mask of its own and, at batch 1, reads v in place (its save keeps
  the whole q/k/v output); ``resid_pdrop`` and ``embd_pdrop`` keep their masks. The modules' locals
  count under checkpointing: GPT2Block holds the attention's output (and, eager, its weights)
  until it returns, GPT2Model the token and position embeddings (and the causal mask) until
  ln_f, the loss the hidden state it was handed. GPT2Model hands a layer the causal mask as a
  positional argument, which a checkpoint saves through the saved-tensor hooks, so an activation
  offloader copies it to the host (``Segment.packed_inputs``). The tied head is the estimator's tied weight.
  Not modelled (traced, with the reason): an activation other than gelu_new and gelu (or gelu
  under LoRA), cross
  attention, eager ``reorder_and_upcast_attn`` and dropouts some zero and some not
  (:func:`why_gpt2_not_modelled`).

* What a model holds beyond its ops' saves (:func:`~memtrain.analysis.estimate.hf_nodes.hf_model_input_nodes`):
  positions, rotary tables and the eager float causal mask, made once and handed to every layer
  (a checkpointed layer keeps them until its backward: ``Segment.held_inputs``); the embedding
  output until the model returns; a layer's input, rope's q/k/v, eager attention's weights and
  repeated k/v until their function returns.

Everything else (separate q/k/v projections = one fused one for memory; gate_proj and up_proj
run one after the other, each making its own weight gradient, so a checkpointed layer frees
gate's output once silu has read it; SDPA/eager attention, checkpointing, the loss) is the
estimator's own inventory. Families not listed in :data:`MODELLED` (Gemma-2 and later:
soft-capping, sandwich norms) are not modelled: ``estimate`` traces them and says so.

* QLoRA (``--qlora``, memtrain.models.qlora): every frozen decoder Linear whose weight divides into
  torchao's 64 x 256-value blocks holds an NF4Tensor (q_proj, k_proj and v_proj each on its own:
  a narrow k/v may stay in its dtype); its bytes are the NF4Tensor's inner tensors
  (:func:`memtrain.techniques.facts.nf4_bytes`, ``ParamInfo.nf4``). Each call of such a Linear is
  torchao's ``LinearNF4``: it dequantizes the weight (int64 codes, table lookups, repeated
  scales, a stack: :func:`~memtrain.analysis.estimate.linear_nodes.nf4_dequantize_steps`), saves only
  the NF4 parameter, dequantizes again in backward, and in a checkpointed layer's recompute
  (``linear_nodes._nf4_linear``); a bias is added after it (float32 under autocast). Not modelled,
  so traced: GPT-2 (its Conv1D projections are no nn.Linear for QLoRA to quantize) and FSDP2
  sharding of the NF4 weights (:func:`why_qlora_not_modelled`).
* Under autocast rope's float32 q and k (the bf16 projections times the float32 tables), with v,
  are the attention function's locals until o_proj has run, while the kernels keep bf16 copies
  (``hf_nodes.held_locals``); eager attention's repeat_kv copies the float32 k in float32, and
  adding the model's float32 mask makes the scores float32, which the softmax reads uncast.
* Phi-3's attention and MLP hold their fused output as a local until they return (``qkv``, whose
  slice v is, until o_proj has run; ``gate``, a chunk of gate_up_proj's output, until down_proj
  has), whether or not an op saved it.
* Phi-3's fused gate/up output is chunked: its gradient is the concatenation of gate's and up's,
  (N, 2 d_ff), made before the Linear's backward runs.
* A sliding window no longer than the sequence (config.json's on every layer, ``Arch.sliding_window``,
  or ``--window``) with SDPA on CPU kernels (``Dims.masked_sdpa``): the model's bool windowed mask,
  ``repeat_kv``'s copies of k and v, SDPA's autocast casts and the float copy of the mask the CPU
  flash kernel saves per layer (``attention_nodes._masked_sdpa_nodes``). On CUDA kernels it is traced
  (:func:`why_not_modelled`).
* Qwen2 with a sliding layer (config.json's ``use_sliding_window``, or ``--window``) and eager
  attention: its model makes the full causal mask beside the windowed one (``Arch.full_mask_beside_window``,
  ``Dims.full_mask``) and hands each layer its kind's, so a checkpointed layer keeps its own until its
  backward (``inventory.layer_held_inputs``; layers of both kinds, ``Arch.layer_slides``, are simulated
  block by block, never lumped).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from memtrain.analysis.estimate.params import hf_lora_modules
from memtrain.analysis.estimate.training import estimate
from memtrain.config.archs import GPT2_ARCH, LLAMA_ARCH, Arch
from memtrain.models.light_config import analytic_config  # torch-free for the modelled families
from memtrain.models.spec import (
    QKV_BIAS,
    config_head_dim,
    config_window,
    every_decoder_linear,
    is_hf,
    with_config_biases,
)

__all__ = ["MODELLED", "QKV_BIAS", "active_window", "config_sliding_layers", "config_window", "hf_arch", "modelled_arch",
           "why_not_modelled", "why_generate_not_modelled", "why_gpt2_not_modelled",
           "why_targets_not_modelled", "why_qlora_not_modelled", "analytic_estimate"]

# model_type -> the layer code is Llama's (modeling_qwen2/modeling_mistral copy it)
MODELLED = ("llama", "qwen2", "mistral", "phi3", "gemma", "gpt2")
# Families whose q/k/v and gate/up are one Linear each, split by slicing (Phi-3).
FUSED_PROJ = ("phi3",)
# Families with Gemma's float32 ``x * (1 + w)`` RMSNorm, sqrt(hidden)-scaled embeddings and a
# tanh-GELU gate (memory-wise SiLU's: one kernel each way, saving its input).
GEMMA_LIKE = ("gemma",)
# Families with GPT-2's layers (transformers' GPT2LMHeadModel): our GPT's inventory (LayerNorm,
# learned positions, biases, one fused q/k/v projection) with transformers' activation and peft.
GPT2_LIKE = ("gpt2",)
# Families whose model makes the full causal mask beside the windowed one when a layer slides
# (Qwen2Model's causal_mask_mapping; Mistral and Phi-3 make one mask, windowed or not).
FULL_MASK_BESIDE_WINDOW = ("qwen2",)
# GPT-2 activations modelled: gelu_new (transformers' NewGELUActivation formula) and gelu (one kernel).
GPT2_ACTIVATIONS = ("gelu_new", "gelu")
GPT2_DROPOUTS = ("attn_pdrop", "resid_pdrop", "embd_pdrop")
# The --distributed choices that shard weights with FSDP2 (NF4 shards: not modelled).
FSDP_SHARDS = ("zero2", "fsdp", "deepspeed-zero2", "deepspeed-zero3")


def config_sliding_layers(c: Any) -> Optional[list[bool]]:
    """Which decoder layers slide when :func:`config_window` is set: from ``layer_types``
    (Qwen2's ``max_window_layers``: the later ones), or None where every layer does (Mistral's
    and Phi-3's ``sliding_window``)."""
    types = getattr(c, "layer_types", None)
    return None if types is None else [t == "sliding_attention" for t in types]


def active_window(c: Any, window: Optional[int], seq_len: int) -> Optional[int]:
    """The sliding window that changes a step of ``seq_len`` tokens (``window``: ``--window``,
    else :func:`config_window`), or None.

    transformers skips the attention mask only while the sequence is shorter than the window
    (masking_utils: ``kv_length < local_attention_size``); from ``seq_len >= window`` on it
    builds the windowed mask: eager attention adds it as it adds the causal one (the same
    tensors), SDPA then gets it instead of ``is_causal`` (``Dims.masked_sdpa``)."""
    if window is None:
        window = config_window(c)
        if window is None:
            return None
    return int(window) if int(window) <= seq_len else None


def _some_layers_slide(c: Any) -> bool:
    """Whether config.json slides some decoder layers and not others (Qwen2's layers below
    ``max_window_layers`` attend in full)."""
    types = getattr(c, "layer_types", None) or []
    return "sliding_attention" in types and "full_attention" in types


def _why_family_not_modelled(c: Any, m: Any) -> Optional[str]:
    """Why the analytic model does not cover the transformers config ``c`` read into the run's
    shape ``m`` (a ModelConfig) whatever the techniques, or None."""
    if c.model_type not in MODELLED:
        return f"no analytic model of {c.model_type} layers (only {', '.join(MODELLED)})"
    heads = int(getattr(c, "num_attention_heads", 0) or getattr(c, "n_head", 0) or 0)
    if heads and m.n_heads != heads:
        # A head count that does not divide hidden_size (Gemma's config allows it with a head_dim
        # of its own) is read into the run's shape as one head, which the inventory would size
        # every head-wide tensor by (a width-136 Gemma with 3 heads of 8: 24,208 parameters of
        # 32,912, -20% forward).
        return f"{heads} attention heads that do not divide hidden_size {m.d_model} are not modelled analytically"
    return None


def why_not_modelled(cfg: Any, device_type: Optional[str] = None) -> Optional[str]:
    """None when the analytic model covers ``cfg`` (a RunConfig of a transformers model), else
    the reason it does not (the estimate then traces). ``device_type``: the kernels estimated
    ("cpu" or "cuda"); None where the caller does not know them (a windowed SDPA step, modelled
    on CPU kernels only, is then not modelled)."""
    c = analytic_config(cfg.model.model)
    tech = cfg.technique
    family = _why_family_not_modelled(c, cfg.model)
    if family is not None:
        return family
    if tech.qlora:
        qlora = why_qlora_not_modelled(c, tech)
        if qlora is not None:
            return qlora
    if tech.lora_rank and not every_decoder_linear(tech.lora_targets):
        unknown = why_targets_not_modelled(c, tech.lora_targets)
        if unknown is not None:
            return unknown
    window = active_window(c, tech.window, cfg.train.seq_len)
    if window is not None and tech.attention != "math":
        # Eager attention adds the model's float mask, windowed or not: the same tensors. SDPA gets
        # that mask instead of is_causal: transformers repeats the k/v heads for it, and the CPU
        # kernel turns the bool mask into a float one per layer, which its backward keeps
        # (Dims.masked_sdpa).
        windowed = f"sliding-window attention (window {window} <= --seq-len {cfg.train.seq_len})"
        if tech.attention != "sdpa":
            return (f"{windowed} with --attention {tech.attention} is not modelled analytically (--attention sdpa "
                    "on CPU kernels and eager --attention math are)")
        if tech.window is None and _some_layers_slide(c):
            slide = c.layer_types.count("sliding_attention")
            return (f"{windowed} on {slide} of {len(c.layer_types)} layers (the others attend in full, without a "
                    "mask) is not modelled analytically with --attention sdpa")
        if float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0:
            return f"{windowed} with attention dropout (SDPA's math path) is not modelled analytically"
        if device_type != "cpu":
            # torch's CUDA SDPA picks its fused kernel for a mask by rules and versions not measured
            # here (the memory-efficient one pads the mask to 16 keys), so its copies stay unknown.
            return (f"{windowed} with --attention sdpa on CUDA kernels is not modelled analytically (which fused "
                    "kernel takes the mask, and what it copies of it, is unmeasured; CPU kernels and eager "
                    "--attention math are modelled)")
    if c.model_type in GPT2_LIKE:
        return why_gpt2_not_modelled(c, tech.attention, tech.lora_rank)
    act = "gelu_pytorch_tanh" if c.model_type in GEMMA_LIKE else "silu"
    if getattr(c, "hidden_act", act) != act:
        return f"hidden_act {c.hidden_act} is not modelled analytically for {c.model_type} (only {act})"
    if any(getattr(c, name, 0) for name in ("resid_pdrop", "embd_pdrop")):
        return "dropout on the residual branches or the embedding (resid_pdrop, embd_pdrop) is not modelled analytically"
    rope = getattr(c, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return "a partial rotary embedding (partial_rotary_factor < 1) is not modelled analytically"
    return None


def why_generate_not_modelled(c: Any) -> Optional[str]:
    """None when the generate estimate (memtrain.analysis.estimate.generation) covers the
    transformers config ``c``, else the reason, naming what would be needed."""
    if c.model_type not in MODELLED:
        return f"no analytic model of {c.model_type} layers (only {', '.join(MODELLED)})"
    window = config_window(c)  # the window a DynamicCache caps a sliding layer's keys and values at
    if window is not None and window < 2:
        # DynamicSlidingWindowLayer keeps positions [-window + 1:]: a window of 1 keeps them all.
        return f"sliding_window {window} in config.json is not modelled for generate (a window of at least 2 is)"
    if c.model_type in GPT2_LIKE:
        if c.activation_function not in GPT2_ACTIVATIONS + ("gelu_pytorch_tanh",):
            return (f"activation_function {c.activation_function} is not modelled for gpt2's generate (only "
                    f"{', '.join(GPT2_ACTIVATIONS)}, gelu_pytorch_tanh)")
        if c.add_cross_attention:
            return "GPT-2's cross-attention layers (add_cross_attention) are not modelled"
        return None
    act = "gelu_pytorch_tanh" if c.model_type in GEMMA_LIKE else "silu"
    if getattr(c, "hidden_act", act) != act:
        return f"hidden_act {c.hidden_act} is not modelled for {c.model_type} (only {act})"
    rope = getattr(c, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        return "a partial rotary embedding (partial_rotary_factor < 1) is not modelled"
    return None


def why_qlora_not_modelled(c: Any, tech: Any) -> Optional[str]:
    """:func:`why_not_modelled` for ``--qlora`` on a config ``c`` (``tech``: the run's
    TechniqueConfig): None where its NF4 weights are modelled (``linear_nodes._nf4_linear``)."""
    if c.model_type in GPT2_LIKE:
        # memtrain.models.qlora quantizes nn.Linear weights; GPT-2's projections are Conv1D.
        return "QLoRA on GPT-2 is not modelled analytically (its Conv1D projections are no nn.Linear to quantize)"
    if tech.distributed in FSDP_SHARDS:
        return f"QLoRA's NF4 weights under --distributed {tech.distributed} (FSDP2 shards) are not modelled analytically"
    return None


def why_targets_not_modelled(c: Any, targets: str) -> Optional[str]:
    """:func:`why_not_modelled` for named ``--lora-targets`` on a config ``c``: None when every
    name is one of the family's decoder Linears (:func:`~memtrain.analysis.estimate.params.hf_lora_modules`),
    which peft matches as the last part of a module's path."""
    modules = hf_lora_modules(_arch_of(c))
    unknown = sorted({t.strip() for t in targets.split(",") if t.strip()} - set(modules))
    if not unknown:
        return None
    return (f"--lora-targets {','.join(unknown)} is not modelled analytically for {c.model_type} (only "
            f"all-linear or names among {','.join(modules)})")


def why_gpt2_not_modelled(c: Any, attention: str, lora_rank: int = 0) -> Optional[str]:
    """:func:`why_not_modelled` for a GPT-2 config ``c`` (``attention``: ``--attention``,
    ``lora_rank``: ``--lora-rank``)."""
    if c.activation_function not in GPT2_ACTIVATIONS:
        return (f"activation_function {c.activation_function} is not modelled analytically for gpt2 "
                f"(only {', '.join(GPT2_ACTIVATIONS)})")
    if c.activation_function == "gelu" and lora_rank:
        # Measured: 1.4-5.8% under the trace with checkpointing or the chunked loss (the
        # recompute's temporaries), where gelu_new's inventory is exact; not located yet.
        return "GPT-2 with activation_function gelu under LoRA is not modelled analytically (only gelu_new)"
    if c.add_cross_attention:
        return "GPT-2's cross-attention layers (add_cross_attention) are not modelled analytically"
    if c.reorder_and_upcast_attn and attention == "math":
        return "GPT-2's reorder_and_upcast_attn (float32 eager attention scores) is not modelled analytically"
    # One dropout switch covers every site (memtrain's --dropout mirrors attn_pdrop).
    if len({float(getattr(c, name)) > 0 for name in GPT2_DROPOUTS}) > 1:
        return ("GPT-2 dropouts of which some are zero and some not (attn_pdrop, resid_pdrop, embd_pdrop) are not "
                "modelled analytically")
    return None


def hf_arch(spec: str) -> Arch:
    """The :class:`Arch` of a modelled transformers config (Llama-style layers, its k/v heads;
    GPT-2's: our GPT's with a fused Conv1D q/k/v and its activation)."""
    return _arch_of(analytic_config(spec))


def modelled_arch(cfg: Any, device_type: Optional[str] = None) -> Optional[Arch]:
    """The Arch the analytic model estimates ``cfg`` (a RunConfig) with ``device_type`` kernels:
    memtrain's GPT's, a transformers family's it covers (:func:`hf_arch`), or None where it does
    not (:func:`why_not_modelled` says why: such a run is traced)."""
    if not is_hf(cfg):
        return GPT2_ARCH
    return None if why_not_modelled(cfg, device_type) is not None else hf_arch(cfg.model.model)


def _arch_of(c: Any) -> Arch:
    """:func:`hf_arch` of a config already read."""
    if c.model_type in GPT2_LIKE:
        return replace(GPT2_ARCH, hf=True, gpt2_layers=True, mlp="gelu_new" if c.activation_function == "gelu_new" else "gelu")
    arch = replace(LLAMA_ARCH, name=c.model_type, n_kv_heads=getattr(c, "num_key_value_heads", None), hf=True,
                   head_dim=config_head_dim(c), fused_proj=c.model_type in FUSED_PROJ,
                   norm_offset=c.model_type in GEMMA_LIKE, embed_scale=c.model_type in GEMMA_LIKE,
                   sliding_window=config_window(c), full_mask_beside_window=c.model_type in FULL_MASK_BESIDE_WINDOW,
                   layer_slides=tuple(config_sliding_layers(c) or ()) if _some_layers_slide(c) else ())
    return with_config_biases(arch, c)


def analytic_estimate(cfg: Any, device_type: str, gpu: Optional[str] = None, world_size: int = 1,
                      shard: Optional[str] = None) -> Optional[Any]:
    """memtrain.analysis.estimate.estimate of ``cfg`` with the transformers inventory, or None when the
    family or technique is not modelled (see :func:`why_not_modelled`). ``gpu`` (CUDA kernels):
    also replay the step through the caching-allocator model (``device_memory``).
    ``world_size``/``shard``: one rank's share under ``--distributed``, by the same rules as for
    our GPT (the wrap is the same: DDP buckets, ZeRO-1 dim-0 chunks, FSDP2 per decoder layer
    plus the root group)."""
    if why_not_modelled(cfg, device_type) is not None:
        return None
    return estimate(cfg, hf_arch(cfg.model.model), device_type, world_size=world_size, shard=shard, gpu=gpu)
