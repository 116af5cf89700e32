"""What identifies a transformers ``--model`` for ``--resume``: the content of its config.json,
not its path. A folder moved or copied elsewhere is the same model; another model copied to the
same path is not (its architecture, sizes or any field its family reads may differ).

The weights of the folder are not part of it: a checkpoint holds every weight of the model it
trained (LoRA's frozen base and QLoRA's NF4 base included), and a resume loads them over the
folder's, so the folder's weights never reach a resumed step. Torch-free: Python's json only.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from memtrain.errors import ConfigError, shortened
from memtrain.models.config_json import json_object
from memtrain.models.source import resolve
from memtrain.models.spec import is_gpt_preset

# Fields that record where and by which version a config was written, or the dtype its weights
# were stored in (a run builds the model in its own --precision): none changes the model built.
NOT_IDENTITY = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash"})


def model_config_identity(spec: Optional[str]) -> Optional[dict[str, Any]]:
    """The config.json fields of the transformers model ``spec`` that decide the model built, as
    a plain dict (saved in checkpoints); None for memtrain's GPT (its flags are the run config's)
    and for a Hub repository (named by its name, as a Hub dataset is)."""
    if spec is None or is_gpt_preset(spec):
        return None
    try:
        src = resolve(spec)
    except ConfigError:
        return None  # the run's own build says why, in its own words
    if src.config_path is None:
        return None
    data = json_object(src.config_path, "the config.json")
    return {k: v for k, v in data.items() if k not in NOT_IDENTITY}


def identity_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``["field saved -> now", ...]`` for each config.json field that differs, in name order."""
    absent = object()
    out = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key, absent), now.get(key, absent)
        if old != new:
            shown = ["(absent)" if v is absent else shortened(json.dumps(v), 40) for v in (old, new)]
            out.append(f"{key} {shown[0]} -> {shown[1]}")
    return out
