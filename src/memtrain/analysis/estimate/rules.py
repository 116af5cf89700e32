"""Rules of thumb from the literature: bytes per parameter of model state (HF docs, ZeRO)."""

from __future__ import annotations

from typing import Any, Optional

from memtrain.config.run import ConfigError

# --------------------------------------------------------------------------- optimizer rules
# Literature bytes per parameter of optimizer state (not weights, not gradients). Each entry:
# (bytes per trainable parameter, where the number comes from).
OPTIMIZER_RULES: dict[str, tuple[float, str]] = {
    "adamw": (8.0, "HF docs, model memory anatomy: 2 fp32 states (exp_avg, exp_avg_sq)"),
    "adafactor": (4.0, "HF docs, efficient training on one GPU: 'slightly more than 4 bytes'; "
                       "that is a fp32 first moment (Adafactor with beta1) plus the factored "
                       "second moment (row + column vectors, ~0 B/param)"),
    "adamw-8bit": (2.0, "HF docs / bitsandbytes: 2 states x 1 byte (block-wise scales not counted)"),
    "adamw-4bit": (1.0, "2 states x 4 bits (torchao; scales not counted)"),
    "sgd": (4.0, "HF docs: SGD with momentum keeps 1 fp32 state"),
    # ZeRO paper (Rajbhandari et al. 2020), K = 12 for mixed-precision Adam: the fp32 master
    # copy of the weights (4) counts as optimizer state next to the two fp32 moments (4 + 4).
    "adamw-mixed": (12.0, "ZeRO paper K=12: fp32 master weights + 2 fp32 Adam states"),
}
_RULE_ALIASES = {"adamw-fused": "adamw", "adamw-foreach": "adamw", "adamw-bnb-8bit": "adamw-8bit"}


def model_state_rule(params: int, optim: str = "adamw", trainable: Optional[int] = None,
                     mixed_precision: bool = False) -> dict[str, Any]:
    """The literature's model-state memory: bytes per parameter times the count.

    ``trainable`` (LoRA) restricts optimizer state to the trained parameters. With
    ``mixed_precision`` and an Adam-type optimizer the ZeRO K=12 rule applies (fp32 master
    weights held by the optimizer); e.g. a 7B model with 0.2B LoRA parameters: 0.2e9 x 12 =
    2.4 GB of optimizer memory, against 7e9 x 12 = 84 GB for full fine-tuning.
    """
    name = _RULE_ALIASES.get(optim, optim)
    if mixed_precision and name == "adamw":
        name = "adamw-mixed"
    if name not in OPTIMIZER_RULES:
        raise ConfigError(f"no literature rule for --optim {optim}; known: {', '.join(sorted(OPTIMIZER_RULES))}")
    per, source = OPTIMIZER_RULES[name]
    n = params if trainable is None else trainable
    return {"optimizer": name, "bytes_per_param": per, "optimizer_bytes": per * n,
            "parameters": params, "trainable_parameters": n, "source": source}

