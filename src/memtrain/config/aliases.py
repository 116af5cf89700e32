"""The option names of transformers' ``TrainingArguments``, accepted as aliases of ours.

A user coming from ``transformers.Trainer`` types ``--learning_rate 3e-4 --bf16
--gradient_checkpointing``; each such name maps onto one memtrain config field here, in one
table, so the command line (:mod:`memtrain.cli`) and config files (:func:`memtrain.config.run.build_config`)
accept the same names. Both spellings work on the command line: ``--learning_rate`` and
``--learning-rate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from memtrain.techniques.facts import ADAM_EPSILON


@dataclass(frozen=True)
class Alias:
    """One Trainer option name and the memtrain field it sets.

    ``const`` is set for the Trainer's on/off switches: ``--bf16`` alone sets
    ``precision=bf16``; ``--bf16 false`` (the Trainer's explicit form) leaves the field alone.
    When ``const`` is None the alias takes a value, passed through unchanged, unless ``expand``
    turns the value into memtrain settings (several fields, or a refusal as ValueError that says
    which flag to use); ``field`` is then the memtrain field the alias stands for (the verbs
    without that field do not offer the alias).
    """

    name: str
    field: str
    const: Any = None
    help: str = ""
    expand: Optional[Callable[[Any], dict[str, Any]]] = None

    @property
    def is_switch(self) -> bool:
        return self.const is not None


# The Trainer's lr_scheduler_type values memtrain's --schedule can express. The Trainer's
# cosine and linear (its default) decay to 0 (memtrain's stop at --min-lr-ratio, 0.1 by default)
# and its constant has no warm-up (constant_with_warmup has one, as memtrain's constant does).
LR_SCHEDULER_TYPES: dict[str, dict[str, Any]] = {
    "linear": {"schedule": "linear", "min_lr_ratio": 0.0},
    "cosine": {"schedule": "cosine", "min_lr_ratio": 0.0},
    "constant": {"schedule": "constant", "warmup_steps": 0},
    "constant_with_warmup": {"schedule": "constant"},
}
# The settings key of --warmup_ratio: build_config turns it into warm-up steps once --steps is known.
WARMUP_RATIO = "warmup_ratio"

# transformers.TrainingArguments' defaults for the optimizer settings memtrain defaults otherwise
# (setting, the Trainer's value): train's `defaults used:` line names those a fine-tune ran with.
TRAINER_OPTIMIZER_DEFAULTS: tuple[tuple[str, float], ...] = (("lr", 5e-5), ("weight_decay", 0.0), ("beta2", 0.999))


def _lr_scheduler_type(value: Any) -> dict[str, Any]:
    if value not in LR_SCHEDULER_TYPES:
        raise ValueError(f"--lr_scheduler_type {value!r} is not available: memtrain's --schedule is cosine, "
                         f"linear or constant; use --lr_scheduler_type {', '.join(LR_SCHEDULER_TYPES)}")
    return dict(LR_SCHEDULER_TYPES[value])


def _warmup_ratio(value: Any) -> dict[str, Any]:
    try:
        ratio = float(value)
    except (TypeError, ValueError):
        ratio = math.nan
    if isinstance(value, bool) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--warmup_ratio must be a number in [0, 1], got {value!r}")
    return {WARMUP_RATIO: ratio}


def _num_train_epochs(value: Any) -> dict[str, Any]:
    raise ValueError(f"--num_train_epochs {value} has no memtrain equivalent: memtrain runs a number of optimizer "
                     "steps; use --steps N (--max_steps N), one epoch being the training blocks / "
                     "(--batch-size x --grad-accum)")


def _adam_epsilon(value: Any) -> dict[str, Any]:
    """The Trainer's default eps is memtrain's: nothing to set. Another eps cannot be expressed,
    so it is refused rather than silently trained with 1e-8."""
    try:
        eps = float(value)
    except (TypeError, ValueError):
        eps = math.nan
    if isinstance(value, bool) or eps != ADAM_EPSILON:
        raise ValueError(f"--adam_epsilon {value}: memtrain's AdamW uses eps 1e-8 (the Trainer's default) "
                         "and has no setting for another; drop the flag")
    return {}


ALIASES: tuple[Alias, ...] = (
    Alias("bf16", "precision", "bf16", "Trainer's --bf16: same as --precision bf16."),
    Alias("fp16", "precision", "fp16", "Trainer's --fp16: same as --precision fp16."),
    Alias("gradient_checkpointing", "checkpointing", "full", "Trainer's switch: same as --checkpointing full."),
    Alias("torch_compile", "compile", True, "Trainer's switch: same as --compile."),
    Alias("dataloader_pin_memory", "pin_memory", True, "Trainer's switch: same as --pin-memory."),
    Alias("gradient_accumulation_steps", "grad_accum", help="Same as --grad-accum."),
    Alias("learning_rate", "lr", help="Same as --lr."),
    Alias("max_steps", "steps", help="Same as --steps."),
    Alias("per_device_train_batch_size", "batch_size", help="Same as --batch-size."),
    Alias("max_grad_norm", "grad_clip", help="Same as --grad-clip."),
    Alias("output_dir", "out", help="Same as --out."),
    Alias("dataloader_num_workers", "num_workers", help="Same as --num-workers."),
    Alias("lora_r", "lora_rank", help="peft's LoraConfig(r=...): same as --lora-rank."),
    Alias("adam_beta1", "beta1", help="Same as --beta1."),
    Alias("adam_beta2", "beta2", help="Same as --beta2 (the Trainer's default is 0.999, memtrain's 0.95)."),
    # Offered where the betas are (field beta1): eps belongs to the same optimizer.
    Alias("adam_epsilon", "beta1", expand=_adam_epsilon,
          help="Accepted at the Trainer's default 1e-8, memtrain's AdamW eps; another value is refused."),
    Alias("model_name_or_path", "model", help="Same as --model (a config.json, a directory, a bundled name or hf:ORG/NAME)."),
    Alias("resume_from_checkpoint", "resume", help="Same as --resume (a checkpoint file written by --save)."),
    Alias("save_steps", "save_every", help="Same as --save-every (checkpoints go to --save)."),
    Alias("logging_steps", "log_every", help="Same as --log-every."),
    Alias("eval_steps", "eval_every", help="Same as --eval-every."),
    Alias("warmup_ratio", "warmup_steps", expand=_warmup_ratio,
          help="Warm-up as a share of --steps: ceil(ratio x steps) warm-up steps (--warmup-steps wins when both are given)."),
    Alias("lr_scheduler_type", "schedule", expand=_lr_scheduler_type,
          help="linear (the Trainer's default; decays to 0: --schedule linear --min-lr-ratio 0), cosine (decays to "
               "0: --schedule cosine --min-lr-ratio 0), constant (--schedule constant --warmup-steps 0) or "
               "constant_with_warmup (--schedule constant); other values are refused."),
    Alias("num_train_epochs", "steps", expand=_num_train_epochs,
          help="Refused: memtrain counts optimizer steps; use --steps (--max_steps)."),
)
BY_NAME: dict[str, Alias] = {a.name: a for a in ALIASES}

# Our --optim values and the Trainer's names of the same optimizer (TrainingArguments.optim,
# transformers.training_args.OptimizerNames), its current name first. The one table of optimizer
# names, read both ways: a Trainer name typed here means the first of ours listed with it
# (OPTIM_VALUES), and the Hugging Face comparison gives the Trainer the first name of ours
# (trainer_optim).
OPTIM_NAMES: dict[str, tuple[str, ...]] = {
    "adamw": ("adamw_torch",),
    # foreach=True: the Trainer's adamw_torch leaves foreach to torch (on for CUDA tensors), so
    # it is the Trainer's nearest name; typed here, adamw_torch means adamw (listed first).
    "adamw-foreach": ("adamw_torch",),
    "adamw-fused": ("adamw_torch_fused",),
    "adafactor": ("adafactor",),
    "adamw-bnb-8bit": ("adamw_bnb_8bit", "adamw_8bit"),  # adamw_8bit: the Trainer's older name
    "adamw-8bit": ("adamw_torch_8bit",),
    "adamw-4bit": ("adamw_torch_4bit",),
    "sgd": ("sgd",),
}


def _optim_values() -> dict[str, str]:
    """The Trainer's --optim values -> ours: :data:`OPTIM_NAMES` read backwards, the first of
    ours listed with a Trainer name taking it."""
    values: dict[str, str] = {}
    for ours, names in OPTIM_NAMES.items():
        for name in names:
            values.setdefault(name, ours)
    return values


OPTIM_VALUES: dict[str, str] = _optim_values()


def trainer_optim(optim: str) -> Optional[str]:
    """The Trainer's ``TrainingArguments.optim`` name of our ``--optim`` value (None: it has none)."""
    names = OPTIM_NAMES.get(optim)
    return names[0] if names else None


# Aliases whose value is expanded (several settings, or a refusal): the CLI keeps them under
# their own name until build_config expands them.
EXPANDED: frozenset[str] = frozenset(a.name for a in ALIASES if a.expand is not None)

# Fields whose values have Trainer spellings.
VALUE_ALIASES: dict[str, dict[str, str]] = {"optim": OPTIM_VALUES}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def switch_value(alias: Alias, given: Optional[str]) -> Any:
    """The field value of a switch alias given as ``--bf16`` (given None) or ``--bf16 VALUE``.

    Returns ``None`` for an explicit false on a switch that selects a value (``--bf16 false``
    asks for no change); raises ValueError on a word that is not a boolean.
    """
    if given is None or str(given).lower() in _TRUE:
        return alias.const
    if str(given).lower() in _FALSE:
        return False if isinstance(alias.const, bool) else None
    raise ValueError(f"--{alias.name} takes true or false, got {given!r}")


def flag_text(field: str, value: Any) -> str:
    """How ``field = value`` reads on the command line (``--precision fp16``, ``--no-compile``)."""
    dashed = field.replace("_", "-")
    if isinstance(value, bool):
        return f"--{dashed}" if value else f"--no-{dashed}"
    return f"--{dashed} {value}"


def refuse_disagreement(field: str, given: list[tuple[str, Any]]) -> None:
    """Refuse a switch alias beside another name of its field asking for another value (``--fp16``
    with ``--bf16``, ``--precision fp16`` with ``--bf16``): whichever came last would silently win,
    and transformers' Trainer refuses fp16 with bf16 too. ``given``: (how it was written, value)."""
    values: dict[Any, Any] = {}  # each value asked for, as first written
    for _, value in given:
        values.setdefault(_comparable(value), value)
    if len(values) > 1:
        names = " and ".join(dict.fromkeys(name for name, _ in given))
        raise ValueError(f"{names} ask for different --{field.replace('_', '-')} "
                         f"({', '.join(map(str, values.values()))}); keep one of them")


def _comparable(value: Any) -> Any:
    """A boolean written as a word in a config file (``compile: "true"``) compares as the boolean,
    a number written as text (YAML reads ``1e-3`` as a string) as the number."""
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def normalize_value(field: str, value: Any) -> Any:
    """Translate a Trainer spelling of a value (``adamw_torch_fused``) into ours."""
    table = VALUE_ALIASES.get(field)
    if table is None or not isinstance(value, str):
        return value
    # Exact Trainer spellings only: a dash-to-underscore fallback would turn our own
    # "adamw-8bit" (torchao) into the Trainer's "adamw_8bit" (bitsandbytes).
    return table.get(value, value)


def normalize(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat settings dict with Trainer names and values replaced by ours (config files).

    A switch alias in a file (``bf16: true``) behaves as on the command line, and is refused
    beside another switch or its target set to another value (``fp16: true`` with ``bf16: true``,
    ``precision: fp16`` with ``bf16: true``); any other alias beside its target is refused when
    the two ask for different values (``learning_rate`` with ``lr``), and is the same setting
    twice when they agree. An expanding
    alias (``lr_scheduler_type``) adds each setting it stands for; ``warmup_ratio`` stays a key
    of its own (:data:`WARMUP_RATIO`) for build_config to resolve against --steps. Raises
    ValueError for a value memtrain cannot express.
    """
    out: dict[str, Any] = {}
    from_alias: dict[str, Any] = {}
    switched: dict[str, list[tuple[str, Any]]] = {}  # field -> the switches that set it
    for key, value in flat.items():
        alias = BY_NAME.get(key)
        if alias is None:
            out[key] = normalize_value(key, value)
            continue
        if alias.is_switch:
            given = None if value is True else ("false" if value is False else str(value))
            value = switch_value(alias, given)
            if value is None:
                continue
            switched.setdefault(alias.field, []).append((f"--{alias.name}", value))
        if alias.expand is not None:
            from_alias.update(alias.expand(value))
            continue
        from_alias[alias.field] = normalize_value(alias.field, value)
        if not alias.is_switch and alias.field in flat:  # its target too: whichever won would hide the other
            refuse_disagreement(alias.field, [(flag_text(alias.field, flat[alias.field]), flat[alias.field]),
                                              (f"--{alias.name}", from_alias[alias.field])])
    for field, switches in switched.items():
        target = [(flag_text(field, out[field]), out[field])] if field in out else []
        refuse_disagreement(field, target + switches)
    return {**from_alias, **out}
