"""The ``transformers.PretrainedConfig`` of a transformers ``--model`` (:func:`load_config`):
read by AutoConfig after memtrain's own checks of its config.json (:mod:`memtrain.models.config_json`),
then refused where transformers would read it and fail to build a model (an unknown activation,
a head_dim of 0, a rope type it has no embedding for, a rotary width its layers cannot turn).

Nothing read here can execute code: ``trust_remote_code`` is never set. transformers (and with
it torch) is imported when a config is read, not when this module is.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memtrain.errors import ConfigError, ConfigFieldWarning
from memtrain.models.config_json import read_config_json, refuse_custom_tokenizer
from memtrain.models.hub_access import from_pretrained_kwargs, offline_hint
from memtrain.models.source import resolve


@functools.lru_cache(maxsize=32)
def load_config(spec: str) -> Any:
    """The ``transformers.PretrainedConfig`` of ``spec`` (read once per process)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("--model with a transformers config needs transformers: pip install 'memtrain[hf]'") from None
    src = resolve(spec)
    # A local config.json, or a Hub repository's from the cache (downloaded first when the Hub is
    # reachable): read by memtrain's checks before transformers reads it, so custom code
    # (auto_map) is refused, never offered, and a NaN field or an empty vocabulary is named.
    config_path = src.config_path if src.repo is None else _hub_file(src.repo, "config.json", spec)
    try:
        assert config_path is not None
        data = read_config_json(config_path)
        if src.directory is not None:
            refuse_custom_tokenizer(src.directory)
    except ConfigError as exc:
        raise ConfigError(f"cannot read the model config of --model {spec!r}: {exc}") from None
    try:
        # One code path for a Hub repository, a directory and a config.json file; an offline Hub
        # is read from the local cache only (hub_access: seconds instead of half a minute of retries).
        with _rope_type_warning_dropped() as bad_factor:
            cfg = AutoConfig.from_pretrained(src.repo or str(src.config_path), trust_remote_code=False,
                                             **from_pretrained_kwargs(src.repo))
    except Exception as exc:  # noqa: BLE001 - OSError, bad JSON, or transformers' validation of a field
        # transformers' validation puts the reason on the lines after its headline ("Class
        # validation error for validator ...:" then "ValueError: The hidden size (64) is not a
        # multiple ..."): every line is kept, joined into one.
        why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        why = why if len(why) <= 400 else why[:397] + "..."
        odd = _odd_head_transformers_refused(exc)
        if odd is not None:  # transformers' refusal, in the words memtrain gives every rotary family
            raise ConfigError(_odd_rotary_head_line(spec, data, odd)) from None
        raise ConfigError(f"cannot read the model config of --model {spec!r}: {why}{offline_hint(src.repo)}") from None
    if bad_factor:
        # transformers only warns: a factor of 0 trained to a NaN loss said to need a lower --lr, a
        # string failed as "cannot read the weights".
        raise ConfigError(f"--model {spec!r}: its config.json's rope_scaling factor {bad_factor[0]} is not a number of "
                          "at least 1; fix it, or remove rope_scaling")
    if getattr(cfg, "is_encoder_decoder", False):
        raise ConfigError(f"--model {spec!r} is an encoder-decoder ({cfg.model_type}); memtrain trains causal LMs")
    _refuse_unbuildable(cfg, spec)
    _refuse_kv_heads(cfg, data, spec)
    _refuse_odd_rotary_head(cfg, data, spec)
    _refuse_unrunnable_partial_rotary(cfg, data, spec)
    _settle_stray_fields(cfg, data, spec)
    return cfg


# Attention fields transformers' generate cache reads from any config (cache_utils'
# get_layer_types_and_kwargs: a layer with one keeps only that many keys), while only the families
# whose config class has the field attend that way. A stray one on a Llama (whose layers ignore it)
# left training and the estimate attending over every key and generate over the last few.
CACHE_ATTENTION_FIELDS = ("sliding_window", "attention_chunk_size")
# How close (difflib's ratio) an unknown field must be to a family's field to be called its misspelling.
MISSPELLING_CUTOFF = 0.85


def family_fields(cfg: Any) -> frozenset[str]:
    """The field names the family of ``cfg`` has: those of its config class's defaults, and the
    other names its ``attribute_map`` gives them (GPT-2's ``num_hidden_layers`` for ``n_layer``)."""
    cls = type(cfg)
    return frozenset(cls().to_dict()) | frozenset(getattr(cls, "attribute_map", None) or {})


def _settle_stray_fields(cfg: Any, data: dict[str, Any], spec: str) -> None:
    """What config.json holds that ``cfg``'s family has no setting of (transformers keeps every
    such field as an attribute, and its layers ignore it): an attention field its generate cache
    would read (:data:`CACHE_ATTENTION_FIELDS`) is removed, so that generate attends as training
    and the estimate do; a field named like one of the family's is a likely misspelling. Each is
    one ``warning:`` line."""
    known = family_fields(cfg)
    stray = [name for name in data if name not in known and not name.startswith("_")]
    for name in stray:
        if name in CACHE_ATTENTION_FIELDS and getattr(cfg, name, None) is not None:
            with contextlib.suppress(AttributeError):
                delattr(cfg, name)
            warnings.warn(f"--model {spec!r}: config.json's {name} {data[name]!r} is no {cfg.model_type} setting: its "
                          f"layers attend to every position, and memtrain leaves the field out (transformers' generate "
                          f"cache would have kept only the last {data[name]!r} keys)", ConfigFieldWarning, stacklevel=2)
            continue
        twin = difflib.get_close_matches(name, sorted(known), n=1, cutoff=MISSPELLING_CUTOFF)
        if twin and twin[0] not in data:
            warnings.warn(f"--model {spec!r}: config.json's {name} is no {cfg.model_type} setting (transformers ignores "
                          f"it, and {twin[0]} keeps its default {getattr(cfg, twin[0], None)!r}); did you mean "
                          f"{twin[0]}?", ConfigFieldWarning, stacklevel=2)


# The config fields naming a layer's activation (Llama's family, Gemma, GPT-2 and OPT).
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "activation_function")


def _refuse_unbuildable(cfg: Any, spec: str) -> None:
    """Refuse config values transformers reads without checking and then fails to build a model
    from (a KeyError for an unknown activation, ZeroDivisionError for a head_dim of 0, exit 1),
    whichever verb builds it (train, estimate's trace, generate)."""
    from transformers.activations import ACT2FN  # transformers is loaded by now (load_config)

    for name in ACTIVATION_FIELDS:
        value = getattr(cfg, name, None)
        if value is not None and (not isinstance(value, str) or value not in ACT2FN):
            raise ConfigError(f"--model {spec!r}: its config.json's {name} {value!r} is no activation transformers "
                              f"knows; use one of {', '.join(sorted(ACT2FN))}")
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1):
        raise ConfigError(f"--model {spec!r}: its config.json's head_dim {head_dim!r} is not a positive whole number; "
                          "fix it, or remove it (hidden_size / num_attention_heads is taken)")
    _refuse_unknown_rope_type(cfg, spec)


def _refuse_kv_heads(cfg: Any, data: dict[str, Any], spec: str) -> None:
    """A ``num_key_value_heads`` that is not a positive divisor of ``num_attention_heads``: each
    key/value head serves a whole group of query heads, and transformers builds such a model, then
    fails at the first forward (a tensor size mismatch, or a division by zero), exit 1. StableLM
    takes 32 where the field is unset, whatever the number of heads."""
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    if not isinstance(heads, int) or isinstance(heads, bool) or not isinstance(kv, int) or isinstance(kv, bool):
        return  # a family without grouped heads, or a value transformers' own checks name
    if kv >= 1 and heads % kv == 0:
        return
    where = "" if "num_key_value_heads" in data else f" ({cfg.model_type}'s default where config.json leaves it unset)"
    raise ConfigError(f"--model {spec!r}: num_key_value_heads {kv}{where} does not divide num_attention_heads {heads}; "
                      f"set num_key_value_heads in its config.json to a divisor of {heads} ({heads} for plain "
                      "multi-head attention)")


def _rope_types(parameters: Any) -> list[Any]:
    """The ``rope_type`` values of a config's ``rope_parameters``: one mapping, or one per layer
    type (Gemma-3's ``{"full_attention": {...}, "sliding_attention": {...}}``)."""
    if not isinstance(parameters, dict):
        return []
    if "rope_type" in parameters:
        return [parameters["rope_type"]]
    return [p["rope_type"] for p in parameters.values() if isinstance(p, dict) and "rope_type" in p]


def _refuse_unknown_rope_type(cfg: Any, spec: str) -> None:
    """A ``rope_scaling``/``rope_parameters`` type transformers has no rotary embedding for (no
    ``_validate_<type>_rope_parameters`` on the config): it reads the config with a warning, then
    building the model fails (KeyError: exit 1) in train, a traced estimate, generate."""
    known = sorted(m.group(1) for m in map(_ROPE_VALIDATOR.fullmatch, dir(cfg)) if m)
    for rope_type in _rope_types(getattr(cfg, "rope_parameters", None)):
        if not isinstance(rope_type, str) or rope_type not in known:
            raise ConfigError(f"--model {spec!r}: its config.json's rope_scaling type {rope_type!r} is no rotary "
                              f"embedding transformers knows; use one of {', '.join(known)}, or remove rope_scaling")


def rotary_head_dim(c: Any) -> int:
    """The head width a transformers config ``c`` gives its rotary embedding: its ``head_dim``, else
    ``hidden_size // num_attention_heads`` (transformers' ``_compute_default_rope_parameters``)."""
    return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


def _rotary_widths(c: Any, head_dim: int) -> list[int]:
    """How many of a head's ``head_dim`` channels the rotary embedding of ``c`` turns, per layer
    kind: GPT-J's ``rotary_dim``, else ``head_dim x partial_rotary_factor`` of each
    ``rope_parameters`` entry (one, or one per layer type: Gemma-3). Empty where ``c`` has no
    rotary embedding (GPT-2, OPT; Falcon with ALiBi) or transformers cannot say one head width
    (a heterogeneous config)."""
    if getattr(c, "alibi", False) or getattr(c, "is_heterogeneous", False):
        return []
    rotary_dim = getattr(c, "rotary_dim", None)
    if isinstance(rotary_dim, int) and not isinstance(rotary_dim, bool):
        return [rotary_dim]
    parameters = getattr(c, "rope_parameters", None)
    if not isinstance(parameters, dict) or not parameters:
        return []
    entries = [parameters] if "rope_type" in parameters or "rope_theta" in parameters else list(parameters.values())
    factor = getattr(c, "partial_rotary_factor", None) or 1.0
    return [int(head_dim * float(p.get("partial_rotary_factor", factor))) for p in entries if isinstance(p, dict)]


def _refuse_odd_rotary_head(cfg: Any, data: dict[str, Any], spec: str) -> None:
    """Refuse a rotary embedding that turns a whole head of odd width: its cos/sin tables are
    ``2 x ceil(width / 2)`` wide, one channel wider than q and k, and the first forward fails
    (``RuntimeError: The size of tensor a (19) must match the size of tensor b (20)``, exit 1) in
    train, a trace and generate, while the analytic estimate, plan and maxbatch answered. transformers
    refuses it itself only where the config has a head_dim field (Llama, Mistral, Gemma) and the head
    is wider than 4 (load_config gives that refusal these words); Qwen2, Phi-3, GPT-NeoX and others
    reached the model. A partial rotary embedding narrower than the head is left to the family (an odd
    width runs in Phi-3's and GPT-NeoX's layers, which slice q by the table's width). ``data``:
    config.json's fields, which the line names."""
    try:
        head_dim = rotary_head_dim(cfg)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return  # no head count (Mamba) or no whole size: mirrored_fields names it
    if head_dim % 2 and head_dim in _rotary_widths(cfg, head_dim):
        raise ConfigError(_odd_rotary_head_line(spec, data, head_dim))


# The field and value transformers' rope check (validate_rope) names when it refuses a fully rotated
# odd head (head_dim > 4): "RoPE requires an even rotary dimension, but got `head_dim`=19 with ...",
# transformers 5.24. Only the field and its value are read, so a rewording of the rest of the
# sentence still matches; a refusal without them is shown as transformers worded it.
_REFUSED_HEAD_DIM = re.compile(r"`?head_dim`?\s*=\s*(\d+)")
_ROTARY_WORD = re.compile(r"rotary|rope", re.IGNORECASE)


def _odd_head_transformers_refused(exc: BaseException) -> int | None:
    """The odd head width in transformers' refusal ``exc`` to read a config whose rotary embedding
    turns a whole head of odd width: its rope check's ``ValueError`` (raised as is, or the cause of
    huggingface_hub's class validation error) naming an odd ``head_dim``. None for any other
    failure, which the caller shows untouched."""
    cause = exc if isinstance(exc, ValueError) else exc.__cause__
    if not isinstance(cause, ValueError):
        return None
    text = str(cause)
    named = _REFUSED_HEAD_DIM.search(text)
    if named is None or _ROTARY_WORD.search(text) is None:
        return None
    width = int(named.group(1))
    return width if width % 2 else None


# Families whose attention takes config.json's head_dim (``getattr(config, "head_dim", ...)`` in the
# family's modeling file, transformers 5.24; tests/test_odd_head_dim.py holds each to its source):
# the others' heads (GPT-NeoX's, StableLM's) are hidden_size / num_attention_heads wide, whatever it says.
HEAD_DIM_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "phi", "olmo",
                               "starcoder2"})


def _odd_rotary_head_line(spec: str, data: dict[str, Any], head_dim: int) -> str:
    """The one line refusing an odd ``head_dim`` that a rotary embedding turns whole: where
    config.json's fields (``data``) make that width, and what to change there."""
    why = f"--model {spec!r}: rotary position embeddings need an even head dimension, but head_dim = {head_dim}"
    if data.get("alibi") is True:
        # Falcon with ALiBi turns no channel, and its layers run an odd head; transformers' rope
        # check reads every Falcon config all the same, and refuses it before memtrain sees it.
        why = (f"--model {spec!r}: transformers reads no Falcon config with an odd head dimension, even with alibi "
               f"(which turns no channel), but head_dim = {head_dim}")
    if data.get("head_dim") == head_dim:  # set apart from the hidden size: only head_dim changes it
        return f"{why} (config.json's head_dim); set an even head_dim in its config.json (e.g. {head_dim + 1})"
    hidden = next((data[n] for n in ("hidden_size", "n_embd") if _whole(data.get(n))), None)
    heads = next((data[n] for n in ("num_attention_heads", "n_head") if _whole(data.get(n))), None)
    source = f" from hidden_size {hidden} / {heads} heads" if hidden and heads and hidden // heads == head_dim else ""
    fix = "use a hidden_size and num_attention_heads giving an even head_dim"
    if heads:
        fix += f" (e.g. hidden_size {(head_dim + 1) * heads} for {heads} heads)"
    if data.get("model_type") in HEAD_DIM_FAMILIES:
        fix += f", or set an even head_dim in its config.json (e.g. {head_dim + 1})"
    return f"{why}{source}; {fix}"


# Families whose attention slices q and k at the rotary width it computes itself
# (``int(head_dim x partial_rotary_factor)``; GPT-J's and CodeGen's ``rotary_dim``) while the cos/sin
# tables it multiplies them by are ``2 x ceil(width / 2)`` wide: an odd width fails the first
# forward ("The size of tensor a (5) must match the size of tensor b (6)", exit 1). The other
# families taking a partial width (GPT-NeoX, Phi-3, GLM, Nemotron, ...) slice at the table's width
# and run an odd one, turning one channel more. transformers 5.24; tests/test_odd_head_dim.py runs
# a forward of each.
OWN_WIDTH_FAMILIES = frozenset({"stablelm", "phi", "persimmon", "gpt_neox_japanese", "gptj", "codegen"})
# Of those, the families whose width is config.json's rotary_dim, a number of channels.
ROTARY_DIM_FAMILIES = frozenset({"gptj", "codegen"})
# Families whose layers cut q and k at the table's width (above) and so fail the first forward, as
# the OWN_WIDTH_FAMILIES do, on a partial_rotary_factor over 1 (tables wider than the head) or below
# 0 (no table: torch.arange's "upper bound and lower bound inconsistent"). Llama's family, Qwen2 and
# Gemma turn the whole head whatever the factor says, and run. transformers 5.24; tests run each.
TABLE_WIDTH_FAMILIES = frozenset({"gpt_neox", "phi3", "glm", "glm4", "nemotron", "minimax_m2"})


def _refuse_unrunnable_partial_rotary(cfg: Any, data: dict[str, Any], spec: str) -> None:
    """Refuse a partial rotary width the layers of an :data:`OWN_WIDTH_FAMILIES` family cannot
    run: an odd one, and a GPT-J or CodeGen ``rotary_dim`` that is no even width from 2 to the
    head's (0 and a wider one fail the forward too). An odd head turned whole is
    :func:`_refuse_odd_rotary_head`'s, which runs first."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in OWN_WIDTH_FAMILIES | TABLE_WIDTH_FAMILIES:
        return
    try:
        head_dim = rotary_head_dim(cfg)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return  # no whole head width: mirrored_fields names it
    if model_type in ROTARY_DIM_FAMILIES:
        width = cfg.rotary_dim  # transformers' config check makes it a whole number
        if width % 2 or not 0 < width <= head_dim:
            raise ConfigError(_rotary_dim_line(spec, model_type, head_dim, width))
        return
    try:
        widths = _rotary_widths(cfg, head_dim)
    except (TypeError, ValueError):  # float() of a factor that is no number: the layers fail the same way
        raise ConfigError(f"--model {spec!r}: its config.json's {_partial_factor_field(data)} is not a number; set it "
                          "to a number from 0 to 1") from None
    for width in widths:
        if not 0 <= width <= head_dim:
            raise ConfigError(_partial_factor_range_line(spec, data, cfg, head_dim, width))
        if width % 2 and model_type in OWN_WIDTH_FAMILIES:
            raise ConfigError(_partial_rotary_line(spec, data, cfg, head_dim, width))


def _rotary_dim_line(spec: str, model_type: str, head_dim: int, width: int) -> str:
    """The one line refusing GPT-J's or CodeGen's ``rotary_dim`` ``width`` of a ``head_dim``-wide head."""
    even = min(max(2, width + width % 2), head_dim - head_dim % 2)
    return (f"--model {spec!r}: {model_type}'s rotary_dim must be an even number of channels from 2 to the head "
            f"width {head_dim}, but rotary_dim = {width}; set rotary_dim in its config.json to an even number such "
            f"as {even}")


def _partial_rotary_line(spec: str, data: dict[str, Any], cfg: Any, head_dim: int, width: int) -> str:
    """The one line refusing the odd ``width`` channels that ``cfg``'s ``partial_rotary_factor``
    turns of a ``head_dim``-wide head: the config.json field that sets the factor, and a factor
    that turns one channel more (an even width)."""
    field = _partial_factor_field(data)
    line = (f"{_partial_width_said(spec, data, cfg, head_dim, width)}, and rotary position embeddings need an even "
            "number")
    better = _factor_turning(head_dim, width + 1)
    if better is None:  # no factor of 6 decimals turns it (not met for heads up to 4096)
        return f"{line}; set {field} in its config.json to one giving an even width"
    return f"{line}; set {field} in its config.json to {better} ({width + 1} channels)"


def _partial_factor_range_line(spec: str, data: dict[str, Any], cfg: Any, head_dim: int, width: int) -> str:
    """The one line refusing a partial rotary factor over 1 or below 0: its ``width`` is no number
    of a ``head_dim``-wide head's channels."""
    return (f"{_partial_width_said(spec, data, cfg, head_dim, width)}, which a {head_dim}-channel head does not have; "
            f"set {_partial_factor_field(data)} in its config.json to a number from 0 to 1")


def _partial_width_said(spec: str, data: dict[str, Any], cfg: Any, head_dim: int, width: int) -> str:
    """How ``cfg``'s layers come to turn ``width`` channels of each head: the factor, the
    config.json field that sets it (or that it is the family's default) and the head width."""
    field = _partial_factor_field(data)
    parameters = getattr(cfg, "rope_parameters", None)  # where transformers puts the factor, whichever field set it
    factor = parameters.get("partial_rotary_factor") if isinstance(parameters, dict) else None
    given = "" if field in data or "." in field else f", the {cfg.model_type} default"
    return (f"--model {spec!r}: {cfg.model_type}'s layers turn int(head_dim {head_dim} x {field} {factor}{given}) = "
            f"{width} channels of each head")


def _partial_factor_field(data: dict[str, Any]) -> str:
    """The config.json field that sets a family's partial rotary factor: inside rope_parameters or
    rope_scaling, GPT-NeoX's rotary_pct, else partial_rotary_factor (also where it is the default)."""
    for holder in ("rope_parameters", "rope_scaling"):
        if isinstance(data.get(holder), dict) and "partial_rotary_factor" in data[holder]:
            return f"{holder}.partial_rotary_factor"
    return "rotary_pct" if "rotary_pct" in data else "partial_rotary_factor"


def _factor_turning(head_dim: int, width: int) -> float | None:
    """The smallest factor of six decimals whose ``int(head_dim x factor)`` (how transformers
    derives the width) is ``width``: the plain quotient can land a float step below it (58 / 100)."""
    start = math.ceil(width / head_dim * 1e6)
    return next((k / 1e6 for k in range(start - 1, start + 3) if int(head_dim * (k / 1e6)) == width), None)


def _whole(value: Any) -> bool:
    """Whether a config.json value is a positive whole number (JSON's true is no size)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# The check transformers runs for each rope type it knows (RotaryEmbeddingConfigMixin's methods).
_ROPE_VALIDATOR = re.compile(r"_validate_(\w+)_rope_parameters")
# What transformers logs, reading a config, of a rope type it does not know: the refusal above says it.
_UNKNOWN_ROPE_WARNING = "Missing validation function in 'RotaryEmbeddingConfigMixin'"


# What transformers logs, reading a config, of a rope scaling factor that is no number of at least 1
# (linear, dynamic, yarn, longrope, llama3); the value follows "got ".
_BAD_FACTOR_WARNING = "`rope_parameters`'s factor field must be a float or int >= 1, got "


@contextlib.contextmanager
def _rope_type_warning_dropped() -> Iterator[list[str]]:
    """transformers' warning about an unknown rope type kept off stderr while a config is read:
    :func:`_refuse_unknown_rope_type` refuses that config in its one ``error:`` line. Its warning
    about a bad rope factor is kept off too, its value put in the list yielded: the caller refuses it."""
    rope_log = logging.getLogger("transformers.modeling_rope_utils")
    drop, factors = _DropMessage(_UNKNOWN_ROPE_WARNING), _DropMessage(_BAD_FACTOR_WARNING)
    rope_log.addFilter(drop)
    rope_log.addFilter(factors)
    try:
        yield factors.dropped
    finally:
        rope_log.removeFilter(drop)
        rope_log.removeFilter(factors)


class _DropMessage(logging.Filter):
    """Drops the log records whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.dropped: list[str] = []  # what followed the prefix in each message dropped

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.getMessage())
        if not message.startswith(self.prefix):
            return True
        self.dropped.append(message[len(self.prefix):])
        return False


def _hub_file(repo: str, name: str, spec: str) -> Path:
    """The local copy of file ``name`` of Hub repository ``repo``: from the Hugging Face cache,
    downloaded into it first when the Hub is reachable (huggingface_hub, as transformers reads it)."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, name, **from_pretrained_kwargs(repo)))
    except Exception as exc:  # noqa: BLE001 - absent from the cache, no such repository, no network
        hint = offline_hint(repo)
        if hint and type(exc).__name__ == "LocalEntryNotFoundError":  # the hint says it; huggingface_hub's
            raise ConfigError(f"cannot read the model config of --model {spec!r}{hint}") from None  # names an argument
        why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
        why = why if len(why) <= 300 else why[:297] + "..."
        raise ConfigError(f"cannot read the model config of --model {spec!r}: {why}{hint}") from None
