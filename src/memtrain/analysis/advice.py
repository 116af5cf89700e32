"""What to change when even the smallest step does not fit: one clause of the refusal.

A step that does not fit at batch 1 is over the budget for one of two reasons, and the flags that
help differ: the weights, gradients and optimizer state alone may exceed it (an 8B full fine-tune
on a 24 GiB card: no activation technique helps, only LoRA, bf16 weights or a smaller optimizer
state), or the activations and logits of the one sequence do (checkpointing, the chunked loss, a
shorter sequence). The clause names the flags of the reason that holds, leaving out those the run
already uses.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from memtrain.analysis.estimate import GPT2_ARCH, estimate
from memtrain.analysis.estimate.hf import hf_arch, why_not_modelled
from memtrain.config.run import ConfigError, RunConfig
from memtrain.models import is_hf
from memtrain.techniques.facts import ADAMW_KERNELS  # AdamW's two FP32 moments, which 8-bit AdamW shrinks

# The LoRA rank a refusal names (here and in plan's): a common choice (peft's examples; the QLoRA
# paper's runs use 8-64); the adapters' own size barely moves the peak.
ADVICE_LORA_RANK = 16


def model_state_bytes(cfg: RunConfig, device_type: str) -> Optional[float]:
    """Weights, gradients and optimizer state of ``cfg`` by the analytic estimate (batch 1); None
    where the analytic model does not cover the run (a transformers family or technique it does
    not model: those are traced, which costs seconds a refusal should not)."""
    if is_hf(cfg):
        if why_not_modelled(cfg, device_type) is not None:
            return None
        assert cfg.model.model is not None  # is_hf: a transformers spec
        arch = hf_arch(cfg.model.model)
    else:
        arch = GPT2_ARCH
    try:
        state = estimate(cfg.replace(batch_size=1, grad_accum=1), arch, device_type).extra["model_state"]
    except ConfigError:
        return None
    return float(state["weights"] + state["gradients"] + state["optimizer"])


class Advice(NamedTuple):
    """A clause of a refusal (``text``; "" when there is nothing to name) and whether it is about
    the model's state (``model_state``: then a smaller batch or sequence does not help either)."""

    text: str
    model_state: bool


def save_memory_clause(cfg: RunConfig, budget_bytes: Optional[float], device_type: str,
                       shorter_sequence: bool = True) -> Advice:
    """What to change, for a refusal: the model-state flags when the weights, gradients and
    optimizer state alone exceed ``budget_bytes``, else "save memory with" the activation flags
    the run does not use yet (and "a smaller --seq-len" unless ``shorter_sequence`` is False: the
    caller searches the length itself); "" when the run uses every one of them."""
    tech = cfg.technique
    state = model_state_bytes(cfg, device_type) if budget_bytes else None
    if state is not None and budget_bytes is not None and state > budget_bytes:
        head = f"the weights, gradients and optimizer state alone need {size_text(state)}"
        # Only what saves at least 1% of it (torchao keeps small tensors' moments in FP32, say).
        changes = sorted((c for c in _state_changes(cfg, device_type) if c[2] is None or c[2] < 0.99 * state),
                         key=lambda c: (c[2] is None, c[2] or 0.0))
        if not changes:
            return Advice(f"{head}: shard them with --distributed", True)
        named = [flag + (f" (to {size_text(after)})" if after is not None else "") for flag, _, after in changes]
        text = f"{head}: shrink them with {_either(named)}"
        known = [after for _, _, after in changes if after is not None]
        if len(known) > 1 and min(known) > budget_bytes:
            # No one flag is enough: what they leave together, where the estimate models it.
            together = {k: v for _, overrides, _ in changes for k, v in overrides.items()}
            after_all = _state_after(cfg, together, device_type)
            if after_all is not None:
                text += f"; together to {size_text(after_all)}"
        return Advice(text, True)
    picks = [flag for flag, helps in (("--loss chunked", tech.loss in ("standard", "naive")),
                                      ("--checkpointing full", tech.checkpointing != "full"),
                                      ("--precision bf16", tech.precision in ("fp32", "tf32")))
             if helps]
    if shorter_sequence:
        picks.append("a smaller --seq-len")
    return Advice(f"save memory with {_either(picks)}" if picks else "", False)


def _state_after(cfg: RunConfig, overrides: dict[str, Any], device_type: str) -> Optional[float]:
    """The model's state of ``cfg`` with ``overrides``; None where the run refuses the combination
    or the estimate does not model it."""
    try:
        return model_state_bytes(cfg.replace(**overrides), device_type)
    except ConfigError:
        return None


def _state_changes(cfg: RunConfig, device_type: str) -> list[tuple[str, dict[str, Any], Optional[float]]]:
    """Each flag that shrinks the model's state and the run does not use yet: the flag, its
    settings, and the state it leaves (the same estimate, QLoRA's NF4 weights included; None where
    that is not modelled analytically, as QLoRA on GPT-2 or under FSDP2 sharding)."""
    tech = cfg.technique
    rank = min(ADVICE_LORA_RANK, cfg.model.d_model)
    adapters = bool(tech.lora_rank or tech.qlora)  # then the frozen weights are the state: no optimizer flag helps
    changes = ((f"--lora-rank {rank}", {"lora_rank": rank}, not adapters),
               ("--precision bf16-pure", {"precision": "bf16-pure"}, tech.precision != "bf16-pure"),
               ("--optim adamw-8bit", {"optim": "adamw-8bit"}, not adapters and tech.optim in ADAMW_KERNELS),
               ("--qlora", {"qlora": True}, adapters and not tech.qlora and is_hf(cfg)),
               (f"--lora-rank {rank} --qlora", {"lora_rank": rank, "qlora": True}, not adapters and is_hf(cfg)))
    return [(flag, overrides, _state_after(cfg, overrides, device_type)) for flag, overrides, helps in changes if helps]


def size_text(n: float) -> str:
    """Bytes in MiB under a GiB (a small model's state or step), else in GiB (also fit's verdicts);
    in KiB under 1 MiB, where MiB would round a budget like 1KiB to "0.00 MiB"."""
    if n < 2**20:
        return f"{n / 2**10:.2f} KiB"
    return f"{n / 2**20:.2f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def _either(choices: list[str]) -> str:
    """``a, b or c``."""
    return choices[0] if len(choices) == 1 else f"{', '.join(choices[:-1])} or {choices[-1]}"
