"""Questions about layers of settings before they are built into a RunConfig: each layer
flattened into memtrain's names (the Trainer's aliases read), the layers merged, whether one
names the warm-up, the attention a transformers ``--model`` defaults to, and the refusal of a
warm-up longer than the run. The CLI and the bench ask them of the same layers they then hand
to :func:`memtrain.config.run.build_config`.
"""

from __future__ import annotations

from typing import Any

from memtrain.config.aliases import WARMUP_RATIO, normalize as normalize_aliases
from memtrain.config.run import TrainConfig, flatten
from memtrain.errors import ConfigError


def model_default_attention(*layers: dict[str, Any]) -> dict[str, Any]:
    """A layer setting the attention transformers builds a transformers ``--model`` with (sdpa, or
    eager for Gemma-2), for settings ``layers`` that name such a model and no attention; else
    empty: memtrain's GPT keeps its math default (the seed's lab). train, estimate, plan and
    every bench row use it, so one model gets one default."""
    return attention_default_of(normalized_layers(*layers))


def attention_default_of(flat_layers: list[dict[str, Any]]) -> dict[str, Any]:
    """:func:`model_default_attention` of layers :func:`normalized_layers` has read already."""
    from memtrain.models.spec import default_attention, is_gpt_preset  # torch-free; spec reads config

    merged = merged_layers(flat_layers)
    spec = merged.get("model")
    if "attention" in merged or not isinstance(spec, str) or is_gpt_preset(spec):
        return {}
    return {"attention": default_attention(spec)}


def normalized_layers(*layers: dict[str, Any]) -> list[dict[str, Any]]:
    """Each layer of settings flattened and in memtrain's names (the Trainer's aliases read); a
    layer whose aliases cannot be read is left out (build_config reports it)."""
    flat_layers = []
    for layer in layers:
        try:
            flat_layers.append(normalize_aliases(flatten(layer)))
        except ValueError:
            continue  # build_config reports the bad alias
    return flat_layers


def given_settings(*layers: dict[str, Any]) -> dict[str, Any]:
    """The settings ``layers`` name, flat and in memtrain's names, later layers winning: a layer
    whose aliases cannot be read is left out, as :func:`normalized_layers` leaves it, so its
    unread keys steer nothing (a --resume, a derived --max-seq-len) before build_config
    reports it as the one-line error it is."""
    return merged_layers(normalized_layers(*layers))


def merged_layers(flat_layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Flat layers (as :func:`normalized_layers` returns them) merged into one, later layers winning."""
    merged: dict[str, Any] = {}
    for flat in flat_layers:
        merged.update(flat)
    return merged


def warmup_named(flat_layers: list[dict[str, Any]]) -> bool:
    """Whether a layer of settings (as :func:`normalized_layers` returns them) names the warm-up:
    ``warmup_steps``, or the Trainer's ``warmup_ratio`` / a ``lr_scheduler_type`` that sets it."""
    return any("warmup_steps" in flat or WARMUP_RATIO in flat for flat in flat_layers)


def refuse_long_warmup(t: TrainConfig) -> None:
    """A warm-up the user set that is longer than the run is refused (ConfigError): the schedule
    would end mid-ramp, and the run would never train at the --lr it records."""
    if t.warmup_steps > t.steps:
        raise ConfigError(f"--warmup-steps {t.warmup_steps} is longer than --steps {t.steps}: the learning rate would "
                          f"end at {t.steps / t.warmup_steps:.0%} of --lr; lower --warmup-steps or raise --steps")
