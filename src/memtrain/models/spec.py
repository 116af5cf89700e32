"""What a transformers ``--model`` means to memtrain: the attention and LoRA targets it defaults
to, the ModelConfig fields it mirrors, its window, positions, head width and cost architecture;
whether a spec names memtrain's own GPT. Where a spec comes from is :mod:`memtrain.models.source`,
its config.json read and checked :mod:`memtrain.models.config_json`, its transformers config
:mod:`memtrain.models.auto_config`, and without torch :mod:`memtrain.models.light_config`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from memtrain.config.archs import GPT2_ARCH, LLAMA_ARCH
from memtrain.config.presets import PRESETS
from memtrain.errors import ConfigError
from memtrain.models.auto_config import load_config
from memtrain.models.light_config import analytic_config

# memtrain's default LoRA targets name our GPT's modules; for HF models the default is every
# Linear of the decoder (peft's "all-linear", the QLoRA paper's choice; the LM head excluded).
GPT_LORA_TARGETS = "qkv,proj,fc,fc_out"
ALL_LINEAR = "all-linear"  # peft's name for every Linear of the decoder


# Fewer LoRA targets than every decoder Linear, per model_type: peft's defaults for the family
# (peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING: the attention
# projections the LoRA paper adapted), copied so that the hint naming them costs no torch import
# (tests/test_hf_user_flags.py holds them equal to peft's). GPT-2's q/k/v are one Conv1D, c_attn;
# Phi-3, which peft does not list, fuses them into qkv_proj.
FEWER_LORA_TARGETS: dict[str, str] = {
    "gpt2": "c_attn", "llama": "q_proj,v_proj", "mistral": "q_proj,v_proj", "qwen2": "q_proj,v_proj",
    "qwen3": "q_proj,v_proj", "gemma": "q_proj,v_proj", "gemma2": "q_proj,v_proj", "phi3": "qkv_proj",
}


# The causal LMs transformers builds with eager attention when no attn_implementation is asked:
# their classes do not set _supports_sdpa (transformers 5.24), and asking them for "sdpa" is refused.
# Copied so that a --model's default attention costs no torch import (tests/test_hf_user_flags.py
# holds each entry, and the families docs/models.md names, to transformers' own classes).
NO_SDPA_MODEL_TYPES = frozenset({
    "big_bird", "bigbird_pegasus", "bloom", "cpmant", "deepseek_v4", "falcon_mamba", "flint", "gemma2", "git",
    "got_ocr2", "gpt_neo", "gpt_neox_japanese", "gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4",
    "inkling2_loop_text", "inkling2_text", "mamba", "mamba2", "megatron-bert", "mimo_v2_flash", "mpt", "mvp",
    "openai-gpt", "prophetnet", "reformer", "rembert", "roformer", "rwkv", "trocr", "vaultgemma", "xglm", "xlm",
    "xlnet", "xlstm",
})


def default_attention(spec: str) -> str:
    """memtrain's ``--attention`` for the implementation transformers builds transformers model
    ``spec`` with when none is asked: ``sdpa``, or ``math`` (eager) for a family without SDPA
    (Gemma-2). ``sdpa`` where the config cannot be read: resolving the model reports that."""
    try:
        model_type = analytic_config(spec).model_type
    except ConfigError:
        return "sdpa"
    return attention_of_model_type(model_type)


def attention_of_model_type(model_type: Optional[str]) -> str:
    """memtrain's name of the attention transformers builds a ``model_type`` with by default."""
    return "math" if model_type in NO_SDPA_MODEL_TYPES else "sdpa"


def fewer_lora_targets(spec: str) -> Optional[str]:
    """A ``--lora-targets`` value naming modules that transformers model ``spec`` has (its
    attention projections), or None for a family not listed or a config that cannot be read."""
    try:
        model_type = analytic_config(spec).model_type
    except ConfigError:
        return None
    return FEWER_LORA_TARGETS.get(model_type)


def every_decoder_linear(targets: str) -> bool:
    """Whether ``--lora-targets`` asks for every Linear of the decoder: peft's ``all-linear``, or
    memtrain's default list, which names all of our GPT's (and means all of a transformers model's)."""
    return targets in (GPT_LORA_TARGETS, ALL_LINEAR)


def is_gpt_preset(spec: Optional[str]) -> bool:
    """Whether ``spec`` names memtrain's own GPT (no spec, or one of its presets)."""
    if spec is None:
        return True

    return spec in PRESETS


def is_hf(cfg: Any) -> bool:
    """Whether ``cfg`` (a RunConfig: config.run reads this module, so it is not imported here)
    trains a transformers model rather than memtrain's GPT."""
    return not is_gpt_preset(cfg.model.model)


def mirrored_fields(spec: str) -> dict[str, Any]:
    """The memtrain ModelConfig fields that describe ``spec``'s shape, so that every part of
    memtrain that reads ``cfg.model`` (random batches, FLOP rules, validation of --seq-len and
    --lora-rank) sees the transformers model's real vocabulary, width and length."""
    c = analytic_config(spec)  # a ConfigError of its own when unreadable
    window = config_window(c)
    if window is not None and window < 1 and not isinstance(c.sliding_window, bool):
        # transformers masks every key a query sees with a window of 0 or less: training ran with
        # attention outputs of zero, silently (a config meaning "no window" writes null).
        raise ConfigError(f"--model {spec!r}: its config.json's sliding_window {window} lets no token attend to any "
                          "other; write null for no window, or a window of 1 or more positions")
    if all(getattr(c, name, None) is None for name in HEAD_COUNT_FIELDS):
        # Mamba, RWKV: a causal LM of another kind, whose missing head count read as a config typo.
        raise ConfigError(f"--model {spec!r}: a {getattr(c, 'model_type', 'model')} model has no attention heads "
                          f"({' or '.join(HEAD_COUNT_FIELDS)} in its config.json); memtrain trains Transformer "
                          "decoders, not state-space or recurrent models")
    try:
        return _mirrored_fields(c)
    except (TypeError, ValueError, OverflowError) as exc:  # a size that is missing, text, or not finite
        raise ConfigError(f"--model {spec!r}: its config.json holds a size that is not a whole number ({exc}); "
                          "fix the config") from None


# The config fields that count a Transformer's attention heads (GPT-2's n_head).
HEAD_COUNT_FIELDS = ("num_attention_heads", "n_head")


def _mirrored_fields(c: Any) -> dict[str, Any]:
    get = lambda *names, default=None: next((getattr(c, n) for n in names if getattr(c, n, None) is not None), default)  # noqa: E731
    d_model = int(get("hidden_size", "n_embd", "d_model"))
    n_heads = int(get(*HEAD_COUNT_FIELDS))
    return {
        "vocab_size": int(c.vocab_size),
        "d_model": d_model,
        "n_heads": n_heads if d_model % n_heads == 0 else 1,
        "n_layers": int(get("num_hidden_layers", "n_layer")),
        "d_ff": int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * d_model)),  # ffn_dim: OPT's
        "max_seq_len": int(get("max_position_embeddings", "n_positions", default=2048)),
        "untie_embeddings": not bool(getattr(c, "tie_word_embeddings", True)),
        # attention dropout decides which SDPA kernels a CPU step may use (plan's search space)
        "dropout": float(get("attention_dropout", "attn_pdrop", default=0.0)),
        # memtrain's GPT-only settings, as a transformers model is built: exactly vocab_size rows
        # (a bench preset's padding does not apply) and the biases of its layer code (the analytic
        # model reads the family's, Arch.qkv_bias and the like; GPT-2's layers always have them).
        "vocab_multiple": 1,
        "bias": True,
    }


def preset_fields(spec: str) -> Optional[dict[str, Any]]:
    """ModelConfig fields of a GPT preset named by ``spec`` (None when ``spec`` is no preset).
    The LLaMA presets are analytic approximations no run can build: point to the bundled
    transformers configs instead."""

    if spec not in PRESETS:
        return None
    fields, arch, _ = PRESETS[spec]
    if arch.name != "gpt2":
        raise ConfigError(f"--model {spec} is an analytic approximation (memtrain estimate only); to build or trace "
                          f"a LLaMA use a transformers config (--model llama-3-8b, a config.json or hf:ORG/NAME)")
    return dict(fields)


def model_fields(spec: str) -> dict[str, Any]:
    """The ModelConfig fields ``spec`` sets: a GPT preset's, else those mirrored from its
    transformers config (:func:`memtrain.config.run.ModelConfig.from_spec` applies them)."""
    return preset_fields(spec) or mirrored_fields(spec)


def rotary_positions(spec: str) -> bool:
    """Whether the transformers model ``spec`` encodes positions by rotation (RoPE) rather than in a
    learned table: its step then builds and runs at lengths beyond ``max_position_embeddings``
    (the positions it was trained on end there; RoPE scaling, as in Llama-3.1's configs, moves
    that end), so a memory search may go past it. A learned table (GPT-2's ``n_positions``) has no
    row for a later position."""
    c = load_config(spec)
    if getattr(c, "n_positions", None) is not None:
        return False
    return any(getattr(c, name, None) for name in ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim",
                                                   "rotary_pct", "partial_rotary_factor"))


# Families whose q/k/v projections carry a bias by their layer code, whatever config.json says
# (Qwen2Attention builds q/k/v with bias=True and o_proj without; its configs have no
# attention_bias field).
QKV_BIAS = ("qwen2",)
# Families whose q/k/v and o projections take config.json's attention_bias, and whose gate/up/down
# take its mlp_bias (the others' layer code fixes their biases, whatever the config says).
ATTENTION_BIAS = ("llama", "gemma")
MLP_BIAS = ("llama",)


def with_config_biases(arch: Any, c: Any) -> Any:
    """``arch`` (an :class:`~memtrain.config.archs.Arch`) with the ``qkv_bias``, ``proj_bias`` and
    ``mlp_bias`` that the family of the Llama-style transformers config ``c`` builds
    (:data:`QKV_BIAS`, :data:`ATTENTION_BIAS`, :data:`MLP_BIAS`)."""
    attention_bias = c.model_type in ATTENTION_BIAS and bool(getattr(c, "attention_bias", False))
    return replace(arch, qkv_bias=c.model_type in QKV_BIAS or attention_bias, proj_bias=attention_bias,
                   mlp_bias=c.model_type in MLP_BIAS and bool(getattr(c, "mlp_bias", False)))


def window_refusal(c: Any) -> Optional[str]:
    """Why ``--window`` cannot run on the transformers config ``c`` (a family whose layers have no
    sliding window: Llama, Gemma, GPT-2), or None. The model build refuses such a run, so its
    estimate must too: the analytic one ignored the flag and answered for no window."""
    if hasattr(c, "sliding_window"):
        return None
    return f"--window: {c.model_type} has no sliding-window attention; drop --window"


def config_window(c: Any) -> Optional[int]:
    """config.json's sliding window on the layers that use it (Mistral's and Phi-3's
    ``sliding_window``; Qwen2's with ``use_sliding_window``, on the layers from
    ``max_window_layers`` on), or None. The same layers' ``DynamicCache`` keeps at most the window
    (transformers' ``get_layer_types_and_kwargs`` reads ``layer_types``, which Qwen2's config
    derives from ``use_sliding_window``)."""
    window = getattr(c, "sliding_window", None)
    if window is None or getattr(c, "use_sliding_window", True) is False:
        return None
    types = getattr(c, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None  # Qwen2: only layers past max_window_layers slide
    return int(window)


def config_positions(config: Any) -> Optional[int]:
    """How many positions a transformers model covers (None: no limit in its config): what
    ``memtrain generate`` bounds a prompt and its new tokens by, and its estimate with it."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cost_arch(spec: str) -> Any:
    """The closest :class:`memtrain.analysis.estimate.Arch` of a transformers model, for the plan's
    step-time model and parameter table (orders candidates; memory comes from the trace).
    A gated MLP (Llama, Qwen2, Mistral, Gemma, Phi-3: ``intermediate_size`` + a SiLU/GELU
    gate) is ``llama``-like with its key/value heads, its head width (:func:`config_head_dim`) and
    its biases (:func:`with_config_biases`); GPT-2 is ours."""

    c = load_config(spec)
    if c.model_type == "gpt2":
        return GPT2_ARCH
    return with_config_biases(replace(LLAMA_ARCH, name=c.model_type, n_kv_heads=getattr(c, "num_key_value_heads", None),
                                      head_dim=config_head_dim(c)), c)


def config_head_dim(c: Any) -> Optional[int]:
    """The width of one attention head that the transformers config ``c`` sets apart from
    ``hidden_size / num_attention_heads`` (Gemma-7B: 256 for 3072 / 16; Mistral-Nemo: 128 for
    5120 / 32), as ``Arch.head_dim`` takes it; None where the heads split the hidden size (GPT-2,
    and a config without a head_dim)."""
    head_dim = getattr(c, "head_dim", None)
    heads = getattr(c, "num_attention_heads", None)
    if not head_dim or not heads or head_dim * heads == getattr(c, "hidden_size", None):
        return None
    return int(head_dim)


def model_head_dim(spec: Optional[str]) -> Optional[int]:
    """:func:`config_head_dim` of the model ``spec`` names: None for memtrain's GPT (no spec or a
    preset), whose heads always split d_model."""
    if is_gpt_preset(spec):
        return None
    assert spec is not None  # is_gpt_preset(None) is True
    return config_head_dim(analytic_config(spec))
