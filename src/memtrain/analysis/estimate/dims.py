"""The sizes and dtype facts the op-inventory builders share (:class:`Dims`), read from a run's
config and architecture (:func:`run_dims`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from memtrain.analysis.estimate.params import head_widths
from memtrain.config.archs import Arch
from memtrain.config.run import RunConfig
from memtrain.techniques.facts import precision_facts


@dataclass
class Dims:
    """Sizes the builders share."""

    b: int
    s: int
    d: int
    f: int
    h: int
    kv: int  # width of k and of v (grouped-query attention)
    V: int
    a: float  # bytes per element of the compute dtype (autocast / bf16-pure: 2, fp32: 4)
    r: float  # residual stream dtype
    p: float  # parameter dtype
    autocast: bool
    dropout: bool
    cuda: bool
    # Whether ``dropout`` also drops the embedding and the residual branches (our GPT's and GPT-2's
    # layers) rather than the attention weights alone (a Llama-style transformers layer: its
    # config's attention_dropout is its only dropout).
    branch_dropout: bool = True
    bias: bool = True
    # FSDP2 under autocast gathers weights already in the compute dtype: autocast casts nothing
    # (no cached copies) and the gathered weights are counted by the sharding rule instead.
    weights_in_compute_dtype: bool = False
    hf: bool = False  # a transformers decoder layer (Arch.hf; memtrain.analysis.estimate.hf)
    fp8: bool = False  # --precision fp8: block Linears are torchao Float8Linears (linear_nodes._fp8_linear)
    # Phi-3's layers (Arch.fused_proj): v is a slice of the fused q/k/v output, and rope's cat
    # makes q contiguous as (b, h, s, hd), so SDPA's output is laid out that way too.
    fused_proj: bool = False
    # --lora-dropout > 0: peft drops each adapter's input before lora_A (linear_nodes._lora_dropout).
    lora_dropout: bool = False
    # The eager attention's softmax runs in float32 outside autocast too (Llama's
    # ``softmax(dtype=float32)``); GPT-2's runs in the scores' dtype (float32 under autocast only).
    softmax_fp32: bool = True
    # The attention mask is added as a float tensor, nothing saved (transformers' layers), rather
    # than applied by a masked_fill that saves its bool mask (our GPT).
    additive_mask: bool = False
    # transformers' Llama-style eager attention repeats the k/v heads (repeat_kv) before the
    # scores and holds the copies until it returns.
    repeat_kv: bool = False
    # Width of q and of the attention's output (n_heads x head_dim) where it is not d (a
    # transformers config's head_dim: Arch.head_dim); 0: d.
    hq: int = 0
    # --qlora: a frozen Linear whose weight fits torchao's blocks holds it in NF4 and runs
    # torchao's linear_nf4 (linear_nodes._nf4_linear).
    qlora: bool = False
    # transformers hands SDPA its windowed bool mask instead of ``is_causal`` (a sliding window no
    # longer than the sequence, --attention sdpa): k and v repeated to the q heads, a float copy of
    # the mask per layer, both saved, as the CPU kernels do (attention_nodes._masked_sdpa_nodes;
    # on CUDA kernels hf.why_not_modelled traces the step).
    masked_sdpa: bool = False
    # Eager attention in a Qwen2 model with a sliding layer (Arch.full_mask_beside_window): the model
    # makes the full causal mask beside the windowed one (hf_nodes.FULL_MASK), until it returns.
    full_mask: bool = False
    # ... and some layers attend in full (Arch.layer_slides, in layer order): each layer is handed its
    # kind's mask, the full ones FULL_MASK, so a checkpointed layer keeps that one until its backward.
    layer_slides: tuple[bool, ...] = ()

    @property
    def n(self) -> int:
        return self.b * self.s

    @property
    def qw(self) -> int:
        """The width of q and of the attention's output (the output projection's input)."""
        return self.hq or self.d


def precision_bytes(precision: str) -> tuple[int, int, bool]:
    """(param bytes, compute bytes, autocast) of ``--precision`` (memtrain.techniques.facts)."""
    f = precision_facts(precision)
    return f.param_bytes, f.compute_bytes, f.autocast


def run_dims(cfg: RunConfig, arch: Arch, device_type: str, batch: Optional[int] = None) -> Dims:
    m, t = cfg.model, cfg.train
    pb, ab, autocast = precision_bytes(cfg.technique.precision)
    q, kv = head_widths(m, arch)
    dm = Dims(b=batch or t.batch_size, s=t.seq_len, d=m.d_model, f=m.d_ff, h=m.n_heads, kv=kv,
               hq=q if q != m.d_model else 0, V=m.padded_vocab_size, a=ab,
               r=pb, p=pb, autocast=autocast, dropout=m.dropout > 0, cuda=device_type == "cuda",
               # (A Llama-style config's dropout is its attention_dropout, mirrored as ModelConfig.dropout:
               # its layers and embedding drop nothing else; hf.why_not_modelled refuses Phi-3's others.)
               branch_dropout=not (arch.hf and not arch.gpt2_layers),
               bias=m.bias and arch.name == "gpt2", hf=arch.hf, fp8=precision_facts(cfg.technique.precision).fp8,
               fused_proj=arch.fused_proj, lora_dropout=cfg.technique.lora_rank > 0 and cfg.technique.lora_dropout > 0,
               softmax_fp32=not arch.gpt2_layers, additive_mask=arch.hf,
               repeat_kv=arch.hf and not arch.gpt2_layers,
               qlora=cfg.technique.qlora and arch.hf and not arch.gpt2_layers)
    window = cfg.technique.window if cfg.technique.window is not None else arch.sliding_window
    # (hf.why_not_modelled keeps the rest of a windowed SDPA step out: CUDA kernels, attention
    # dropout, layers of both kinds.)
    dm.masked_sdpa = (arch.hf and not arch.gpt2_layers and cfg.technique.attention == "sdpa"
                      and window is not None and window <= t.seq_len and not dm.dropout)
    # Eager attention materializes the masks whatever the sequence's length; --window slides every layer.
    dm.full_mask = arch.full_mask_beside_window and cfg.technique.attention == "math" and window is not None
    dm.layer_slides = arch.layer_slides if dm.full_mask and cfg.technique.window is None else ()
    return dm
