"""A model folder's ``config.json`` and ``tokenizer_config.json`` read as JSON and checked before
transformers reads them: a JSON object, no custom code (``auto_map``), a ``model_type`` transformers
ships, finite numbers, scale factors that are numbers, a vocabulary. Torch-free: Python's json only
(transformers is imported, where installed, only to list the model types it ships)."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Any, Optional

from memtrain.errors import ConfigError, shortened
from memtrain.files import results
from memtrain.files.json_file import NOT_A_FILE, NOT_JSON, NOT_UTF8, TOO_BIG, JsonFileProblem, read_json_file

# A model's config.json and generation_config.json hold hyper-parameters: tens of kilobytes (a
# classifier's label map a few megabytes). Each is parsed several times (memtrain's checks,
# transformers' config, the run's own copy), so 100 MB of padding cost a train 360 MB more memory;
# past this (a --config file's limit) one is refused from its size, unread.
GENERATION_CONFIG = "generation_config.json"
CONFIG_FILES = ("config.json", GENERATION_CONFIG)
MAX_CONFIG_JSON_BYTES = 16 << 20


def json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path`` (a model folder's config or tokenizer config); a crafted file
    is one error line, never a crash. Read by the one reader of JSON files
    (:func:`memtrain.files.json_file.read_json_file`), with Python's json rather than memtrain's
    bounded parse: tokenizer configs hold 31-digit integers (transformers' "no limit"
    model_max_length). config.json and generation_config.json are bounded by size
    (MAX_CONFIG_JSON_BYTES); a tokenizer config by the folder's read-whole limit, checked before."""
    limit = MAX_CONFIG_JSON_BYTES if path.name in CONFIG_FILES else None
    try:
        data = read_json_file(path, limit, bounded=False)
    except JsonFileProblem as exc:
        raise ConfigError(_json_object_refusal(path, what, exc)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} holds a JSON {type(data).__name__}, not an object; fix or replace {what}")
    return data


def _json_object_refusal(path: Path, what: str, exc: JsonFileProblem) -> str:
    """:func:`json_object`'s line for a file it could not read, by the kind of problem."""
    shown = str(path)
    if exc.kind == TOO_BIG:
        return (f"{shown!r} is larger than {MAX_CONFIG_JSON_BYTES:,} bytes, the most memtrain lets transformers read "
                "whole into memory; replace it with the model's own file")
    if exc.kind == NOT_UTF8:
        return f"cannot read {shown!r} as JSON (not UTF-8 text); fix or replace {what}"
    if exc.kind == NOT_JSON:
        return f"cannot read {shown!r} as JSON ({str(exc)[len('not JSON ('):-1]}); fix or replace {what}"
    if exc.kind == NOT_A_FILE:
        return f"{shown!r} is {exc}; give a model folder whose {path.name} is a file"
    return f"cannot read {shown!r} {str(exc)[len('unreadable '):]}; check its permissions"


def _saved_by_run(folder: Path) -> tuple[bool, Optional[str]]:
    """Whether the ``result.json`` in ``folder`` could be read, and the ``--save`` its run
    recorded (None: the run saved no checkpoint). Read bounded: the folder is any folder."""
    recorded = results.read_result(folder)
    config = recorded.get("config") if recorded is not None else None
    train = config.get("train") if isinstance(config, dict) else None
    if not isinstance(train, dict) or "save" not in train:
        return False, None
    save = train["save"]
    return True, save if isinstance(save, str) and save else None


def run_folder_hint(folder: Path, export_hint: bool = True) -> str:
    """For a ``train --out`` folder given where a model folder or a checkpoint goes (it holds
    result.json, and the run's checkpoint where --save put it there): what to give instead, in
    parentheses; else "". ``export_hint`` adds `memtrain export` (not for export itself)."""
    if not (folder / "result.json").is_file():
        return ""
    ckpts = sorted(p.name for p in folder.glob("*.pt") if p.is_file())
    known, save = (False, None) if ckpts else _saved_by_run(folder)
    if known and save is None:
        # The usual first run: train keeps its weights only with --save, and saying "give the
        # checkpoint its run saved" sent the user looking for a file that was never written.
        return (f" ({str(folder)!r} is the --out folder of a run that saved no checkpoint: train keeps the weights only "
                f"with --save FILE; train again with --save {str(folder / 'ckpt.pt')!r})")
    take = (f"its checkpoint ({str(folder / ckpts[0])!r})" if ckpts
            else f"the checkpoint its run saved with --save ({save!r})" if save
            else "the checkpoint its run saved with --save")
    export = ", or make a model folder of it with `memtrain export CKPT DIR`" if export_hint else ""
    return f" ({str(folder)!r} is a train --out folder: give {take}{export})"


def read_config_json(path: Path) -> dict[str, Any]:
    """A model's ``config.json`` as a dict, checked before transformers reads it: a JSON object
    with a ``model_type`` transformers knows, and no ``auto_map``. A folder whose config names
    custom code (``auto_map``, or a ``model_type`` transformers does not ship) is refused
    outright: memtrain never runs, nor offers to run, Python shipped with a model."""
    shown = str(path)
    if not path.is_file():
        raise ConfigError(f"{shown!r} is missing or not a file; a model folder needs its config.json"
                          + run_folder_hint(path.parent))
    data = json_object(path, "the config.json (it is not a transformers config.json)")
    if "auto_map" in data:
        raise ConfigError(f"{shown!r} names custom model code (auto_map); memtrain never runs code shipped with a "
                          "model: use a model type transformers ships")
    refuse_non_finite(data, shown)
    refuse_bad_scales(data, shown)
    _refuse_no_vocabulary(data, shown)
    model_type = data.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        # A list or a number there is a damaged config, not another kind of file: say which field.
        raise ConfigError(f"{shown!r} has model_type {shortened(repr(model_type), 60)}, where a family's name such as "
                          "'llama' belongs; fix the config.json")
    if not model_type:
        raise ConfigError(f"{shown!r} has no 'model_type'; it is not a transformers config.json")
    if model_type not in _shipped_model_types():
        raise ConfigError(f"{shown!r} has model_type {model_type!r}, which this transformers does not ship (custom "
                          "code is never run); use a model type transformers ships, or upgrade transformers")
    _check_generation_config(path.parent / GENERATION_CONFIG)
    return data


def _check_generation_config(path: Path) -> None:
    """A model folder's generation_config.json, when there, must be a JSON object: transformers
    reads it while loading the weights, and a garbled one (100,000 levels deep) was said as
    "cannot read the weights of --model DIR (RecursionError ...); its *.safetensors files must be
    complete", sending the user to the wrong file."""
    if path.is_file():
        json_object(path, "the generation_config.json (or remove it: transformers then derives one)")


def refuse_non_finite(data: dict[str, Any], shown: str) -> None:
    """Refuse a config.json number that is not finite (Python's json reads NaN, Infinity and
    1e999), naming its field: an ``rms_norm_eps`` of NaN built a model whose loss was NaN from
    the first step, reported as a divergence to fix with a lower --lr."""
    queue = collections.deque(data.items())  # the top level first, in the file's order
    while queue:  # no recursion: json.loads accepted the nesting, a Python walk might not
        name, value = queue.popleft()
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{shown!r} has {name} {json.dumps(value)}, not a finite number; write a number there "
                              "(or remove the field for transformers' default)")
        if isinstance(value, dict):
            queue.extend((f"{name}.{key}", item) for key, item in value.items())
        elif isinstance(value, list):
            queue.extend((f"{name}[{i}]", item) for i, item in enumerate(value))


# The scale factors a family's modeling file multiplies (or, ``DIVIDES``, divides) hidden states
# or logits by. transformers types some as optional (Cohere's ``logit_scale: float | None``) and
# older releases check none, so a null or a string stopped `generate` with `Tensor * None`'s
# TypeError (exit 1), and a divisor of 0 stopped `train` with a ZeroDivisionError.
_GRANITE_SCALES = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
SCALE_FIELDS: dict[str, tuple[str, ...]] = {
    **{t: _GRANITE_SCALES for t in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                                    "granitemoe_swa", "hyperclovax")},
    **{t: ("logit_scale",) for t in ("cohere", "cohere2", "cohere2_moe")},
    "falcon_h1": ("lm_head_multiplier", "embedding_multiplier", "key_multiplier", "attention_in_multiplier",
                  "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier"),
    "minicpm3": ("scale_emb", "scale_depth", "dim_model_base"),
}
SCALE_DIVISORS = frozenset({"logits_scaling", "dim_model_base"})
# Nulls the family's config turns into its no-op scale (MiniCPM3Config.__post_init__).
SCALE_NULLS = {"minicpm3": frozenset({"scale_depth", "dim_model_base"})}


def refuse_bad_scales(data: dict[str, Any], shown: str) -> None:
    """Refuse a scale field of the config's family (:data:`SCALE_FIELDS`) that is not a number (a
    null, a string, true), is too large for a float, or is 0 where the model divides by it."""
    family = data.get("model_type")
    if not isinstance(family, str):
        return  # read_config_json names a missing model_type
    for name in SCALE_FIELDS.get(family, ()):
        if name not in data or (data[name] is None and name in SCALE_NULLS.get(family, ())):
            continue
        value, divisor = data[name], name in SCALE_DIVISORS
        problem = _scale_problem(value, divisor)
        if problem:
            uses, wanted = ("divides by", "a number other than 0") if divisor else ("multiplies by", "a number")
            said = "" if problem == "zero" else f", {problem}"
            raise ConfigError(f"{shown!r} has {name} {shortened(json.dumps(value))}{said}; {family} {uses} it: write "
                              f"{wanted} there (or remove the field for transformers' default)")


def _scale_problem(value: Any, divisor: bool) -> str:
    """Why ``value`` cannot be a scale factor ("" when it can)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "not a number"
    try:
        if not math.isfinite(float(value)):
            return "not a finite number"
    except OverflowError:  # an integer of hundreds of digits
        return "too large for a float"
    return "zero" if divisor and value == 0 else ""


def _refuse_no_vocabulary(data: dict[str, Any], shown: str) -> None:
    """Refuse a ``vocab_size`` of 0 or below before transformers reads the config: it logs a
    line per special token outside the (empty) vocabulary ahead of memtrain's own refusal."""
    vocab = data.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < 1:
        raise ConfigError(f"{shown!r} has vocab_size {vocab}; a model needs a vocabulary of at least one token: "
                          "fix the config")


def _shipped_model_types() -> Any:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    except ImportError:
        raise ConfigError("a transformers model needs transformers: pip install 'memtrain[hf]'") from None
    return CONFIG_MAPPING_NAMES


def refuse_custom_tokenizer(directory: Path) -> None:
    """Refuse a folder whose ``tokenizer_config.json`` names custom tokenizer code (``auto_map``)."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return  # no file, or not a file: the tokenizer's loader reports it
    if "auto_map" in json_object(path, "it"):
        raise ConfigError(f"{str(path)!r} names custom tokenizer code (auto_map); memtrain never runs code shipped "
                          "with a model: use a tokenizer class transformers ships")
