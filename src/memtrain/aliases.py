"""The option names of transformers' ``TrainingArguments``, accepted as aliases of ours.

A user coming from ``transformers.Trainer`` types ``--learning_rate 3e-4 --bf16
--gradient_checkpointing``; each such name maps onto one memtrain config field here, in one
table, so the command line (:mod:`memtrain.cli`) and config files (:func:`memtrain.config.build_config`)
accept the same names. Both spellings work on the command line: ``--learning_rate`` and
``--learning-rate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Alias:
    """One Trainer option name and the memtrain field it sets.

    ``const`` is set for the Trainer's on/off switches: ``--bf16`` alone sets
    ``precision=bf16``; ``--bf16 false`` (the Trainer's explicit form) leaves the field alone.
    When ``const`` is None the alias takes a value, passed through unchanged.
    """

    name: str
    field: str
    const: Any = None
    help: str = ""

    @property
    def is_switch(self) -> bool:
        return self.const is not None


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
)
BY_NAME: dict[str, Alias] = {a.name: a for a in ALIASES}

# Trainer's --optim values (transformers.training_args.OptimizerNames) -> ours.
OPTIM_VALUES: dict[str, str] = {
    "adamw_torch": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "adafactor": "adafactor",
    "adamw_bnb_8bit": "adamw-bnb-8bit",
    "adamw_8bit": "adamw-bnb-8bit",  # the Trainer's older name of the bitsandbytes optimizer
    "adamw_torch_8bit": "adamw-8bit",
    "adamw_torch_4bit": "adamw-4bit",
    "sgd": "sgd",
}
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

    A switch alias in a file (``bf16: true``) behaves as on the command line; an alias and
    its target both present keep the target's value (it is the more specific one).
    """
    out: dict[str, Any] = {}
    from_alias: dict[str, Any] = {}
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
        from_alias[alias.field] = normalize_value(alias.field, value)
    return {**from_alias, **out}
