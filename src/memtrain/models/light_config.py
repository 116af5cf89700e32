"""A transformers ``--model``'s config as the analytic estimate and plan read it
(:func:`analytic_config`), without torch where it can.

transformers imports torch whenever it is installed (its configuration module loads the rope
utilities), so AutoConfig costs seconds and the analytic estimate's torch-free promise. For the
families the analytic estimator models, the fields it and plan read are plain JSON with
transformers' defaults (transformers/models/<type>/configuration_<type>.py, the class fields
and __post_init__); ``tests/test_model_config_reader.py`` holds them equal to AutoConfig's for
every bundled config and for configs with those fields left out.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Optional

from memtrain.errors import ConfigError
from memtrain.models.auto_config import load_config, rotary_head_dim
from memtrain.models.config_json import json_object, refuse_custom_tokenizer, refuse_non_finite
from memtrain.models.source import resolve

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
    if c.model_type != "gpt2" and rotary_head_dim(c) % 2:
        # An odd head the family's rotary embedding turns whole: the model cannot run, and
        # load_config refuses it in one line (auto_config._refuse_odd_rotary_head).
        return None
    kv = getattr(c, "num_key_value_heads", None)
    if isinstance(kv, int) and (kv < 1 or c.num_attention_heads % kv):
        return None  # the model cannot run: load_config refuses it in one line (auto_config._refuse_kv_heads)
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
