"""What a transformers ``--model`` means to memtrain: the attention and LoRA targets it defaults
to, the ModelConfig fields it mirrors, its window, positions, head width and cost architecture;
whether a spec names memtrain's own GPT. Where a spec comes from is :mod:`memtrain.models.source`,
its config.json read and checked :mod:`memtrain.models.config_json`, its transformers config
:mod:`memtrain.models.auto_config`.

Nothing read here can execute code: ``trust_remote_code`` is never set, and weights are read
only from ``*.safetensors`` (never pickled ``*.bin`` files).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Optional

from memtrain.config.archs import GPT2_ARCH, LLAMA_ARCH
from memtrain.config.presets import PRESETS
from memtrain.errors import ConfigError
from memtrain.models.auto_config import load_config
from memtrain.models.config_json import json_object, refuse_custom_tokenizer, refuse_non_finite
from memtrain.models.source import resolve

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


# --------------------------------------------------------------------------- config.json without torch
# transformers imports torch whenever it is installed (its configuration module loads the rope
# utilities), so AutoConfig costs seconds and the analytic estimate's torch-free promise. For the
# families the analytic estimator models, the fields it and plan read are plain JSON with
# transformers' defaults (transformers/models/<type>/configuration_<type>.py, the class fields
# and __post_init__); ``tests/test_model_config_reader.py`` holds them equal to AutoConfig's for
# every bundled config and for configs with those fields left out.
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0, "num_key_value_heads": None,
}
ANALYTIC_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
              "attention_bias": False, "mlp_bias": False, "head_dim": None},
    "qwen2": {**_COMMON_DEFAULTS, "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "layer_types": None, "head_dim": None},
    "mistral": {**_COMMON_DEFAULTS, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 4096 * 32, "sliding_window": 4096, "head_dim": None},
    # GPT-2's own field names (GPT2Config's attribute_map gives hidden_size and the rest: _post_init)
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
             "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
             "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
             "add_cross_attention": False, "tie_word_embeddings": True},
}
# GPT2Config's attribute_map: the common names of its fields.
_GPT2_ALIASES = {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
                 "num_hidden_layers": "n_layer"}
# The fields each family's typed config lets be null (an explicit null elsewhere: AutoConfig refuses it).
_NULLABLE: dict[str, frozenset[str]] = {
    "llama": frozenset({"num_key_value_heads", "head_dim", "attention_dropout"}),
    "qwen2": frozenset({"num_key_value_heads", "sliding_window", "layer_types", "head_dim"}),
    "mistral": frozenset({"head_dim", "sliding_window"}),
    "gpt2": frozenset({"n_inner"}),
}
# The JSON types each field may hold (anything else: AutoConfig's own validation decides).
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "hidden_act": (str,), "tie_word_embeddings": (bool,), "attention_dropout": (int, float),
    "attention_bias": (bool,), "mlp_bias": (bool,), "use_sliding_window": (bool,), "layer_types": (list,),
    "activation_function": (str,), "resid_pdrop": (int, float), "embd_pdrop": (int, float), "attn_pdrop": (int, float),
    "scale_attn_weights": (bool,), "scale_attn_by_inverse_layer_idx": (bool,), "reorder_and_upcast_attn": (bool,),
    "add_cross_attention": (bool,),
}


def analytic_config(spec: str) -> Any:
    """The config of ``spec`` as the analytic estimate and plan read it: a bundled config or a
    local config.json of a family the estimator models, read as JSON with transformers' defaults
    (no torch); anything else (a Hub repository, another model_type, a field of an unexpected
    type, a config transformers would refuse) through :func:`load_config` (AutoConfig, which
    loads torch), rather than guessing what transformers would make of it."""
    light = _read_light_config(spec)
    return light if light is not None else load_config(spec)


@functools.lru_cache(maxsize=32)
def _read_light_config(spec: str) -> Optional[SimpleNamespace]:
    """:func:`analytic_config`'s torch-free reading, or None where it defers to AutoConfig (which
    then also gives any error its own words)."""
    try:
        src = resolve(spec)
        if src.repo is not None or src.config_path is None:
            return None
        data = json_object(src.config_path, "the config.json")
        refuse_non_finite(data, str(src.config_path))  # said by read_config_json, through load_config
        if src.directory is not None:
            refuse_custom_tokenizer(src.directory)
    except ConfigError:
        return None
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in ANALYTIC_CONFIG_DEFAULTS or "auto_map" in data:
        return None
    defaults = ANALYTIC_CONFIG_DEFAULTS[model_type]
    values = {name: data.get(name, default) for name, default in defaults.items()}
    if any(values[name] is None and name not in _NULLABLE[model_type] for name in values) or not _plain_values(values):
        return None
    if not _plain_unread_fields(data, values.get("num_hidden_layers", values.get("n_layer"))):
        return None
    c = SimpleNamespace(model_type=model_type, is_encoder_decoder=False, **values)
    _post_init(c)
    if c.hidden_size % c.num_attention_heads:
        return None  # transformers refuses it (validate_architecture): its message, not ours
    return c


# Fields the analytic estimate does not read but AutoConfig validates, refusing the config (as
# train, --trace and generate then do): read lightly only when they hold what it accepts.
_DTYPE_NAMES = frozenset({"float32", "float16", "bfloat16", "float64", "auto"})
_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def _plain_unread_fields(data: dict[str, Any], layers: Any) -> bool:
    """Whether the config.json fields :func:`_read_light_config` leaves unread hold what
    transformers' typed config accepts: a positive float epsilon, a rope dict (or null), a dtype
    torch has, one known attention kind per layer. Anything else defers to AutoConfig, whose
    refusal is then the estimate's too."""
    for name in ("rms_norm_eps", "layer_norm_epsilon"):
        if name in data and not (isinstance(data[name], float) and data[name] > 0):
            return False
    if any(name in data and not (data[name] is None or isinstance(data[name], dict))
           for name in ("rope_scaling", "rope_parameters")):
        return False
    if not all(data.get(name) is None or data[name] in _DTYPE_NAMES for name in ("torch_dtype", "dtype")):
        return False
    kinds = data.get("layer_types")
    return kinds is None or (isinstance(kinds, list) and len(kinds) == layers
                             and all(isinstance(k, str) and k in _LAYER_TYPES for k in kinds))


def _plain_values(values: dict[str, Any]) -> bool:
    """Whether every field holds what transformers' typed config accepts without conversion:
    whole numbers (not bools) for sizes, the listed JSON types for the rest."""
    for name, value in values.items():
        if value is None:
            continue
        kinds = _FIELD_TYPES.get(name, (int,))
        if isinstance(value, bool) and bool not in kinds:
            return False
        if not isinstance(value, kinds):
            return False
    sizes_positive = all(v is None or _FIELD_TYPES.get(n, (int,)) != (int,) or v > 0 for n, v in values.items())
    names_are_text = all(isinstance(t, str) for t in values.get("layer_types") or ())
    return sizes_positive and names_are_text


def _post_init(c: SimpleNamespace) -> None:
    """The defaults transformers derives from other fields (the families' __post_init__)."""
    if c.model_type == "gpt2":
        for alias, name in _GPT2_ALIASES.items():
            setattr(c, alias, getattr(c, name))
        return
    if "head_dim" in vars(c) and c.head_dim is None:
        if c.model_type == "qwen2":
            del c.head_dim  # Qwen2Config keeps a head_dim only when config.json gives one
        else:
            c.head_dim = c.hidden_size // c.num_attention_heads
    if c.num_key_value_heads is None:
        c.num_key_value_heads = c.num_attention_heads
    if c.model_type == "qwen2":
        c.sliding_window = c.sliding_window if c.use_sliding_window else None
        if c.layer_types is None:
            c.layer_types = ["sliding_attention" if c.sliding_window is not None and i >= c.max_window_layers
                             else "full_attention" for i in range(c.num_hidden_layers)]


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
