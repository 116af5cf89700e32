"""What a technique choice does to the numbers a run computes, besides its speed and memory.

Some techniques compute the same function as the baseline and differ only in rounding order
(an attention kernel, recomputation, a chunked loss); mixed precision with FP32 master weights
is the numerically standard way to train; others change the arithmetic of the weights or the
optimizer, or the model itself. ``plan`` shows this beside each choice and prefers the standard
ones; the bench report uses :func:`numerics_key` to find rows whose PPL differences are noise.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from memtrain.techniques.facts import PRECISION_FACTS

# FP32 master weights (autocast or none): the numerically standard precisions.
STANDARD_PRECISIONS = tuple(name for name, facts in PRECISION_FACTS.items() if facts.param_dtype == "float32")

OPTIM_NOTES = {
    "adamw-8bit": "8-bit optimizer state: changes the optimizer's arithmetic",
    "adamw-bnb-8bit": "8-bit optimizer state: changes the optimizer's arithmetic",
    "adamw-4bit": "4-bit optimizer state: changes the optimizer's arithmetic",
    "adafactor": "Adafactor: a different optimizer (factored second moment)",
    "sgd": "SGD: a different optimizer",
}


def numerics_changes(tech: Mapping[str, Any]) -> list[str]:
    """What ``tech`` (technique field -> value) changes in the numerics; [] = standard."""
    notes: list[str] = []
    precision = tech.get("precision", "fp32")
    if precision == "bf16-pure":
        notes.append("pure BF16 weights: changes the weights' arithmetic (no FP32 master copy)")
    facts = PRECISION_FACTS.get(precision)
    if facts is not None and facts.fp8:
        notes.append("FP8 matmuls (torchao float8, per-tensor scales): changes the Linears' arithmetic")
    optim = tech.get("optim", "adamw")
    if optim in OPTIM_NOTES:
        notes.append(OPTIM_NOTES[optim])
    if tech.get("window"):
        notes.append(f"sliding window {tech['window']}: changes the model")
    if tech.get("lora_rank"):
        notes.append("LoRA: trains adapters only, the base is frozen")
    return notes


def fewest_changes_first(techs: Sequence[Mapping[str, Any]]) -> list[int]:
    """The indices of ``techs`` (candidates, fastest first) reordered by how many numerics changes
    each makes, fewest first, ties kept fastest first: plan recommends the first, and
    ``estimate --budget`` suggests in this order. The fastest candidate may change the weights' or
    the optimizer's arithmetic, which its speed alone does not show; a standard choice changes
    nothing, and when none fits, a change the others need too (LoRA, pure BF16 weights) is no
    reason to add another (8-bit optimizer state) for a modelled gain."""
    return sorted(range(len(techs)), key=lambda i: len(numerics_changes(techs[i])))


def is_standard(tech: Mapping[str, Any]) -> bool:
    """Mixed or full precision with FP32 master weights, AdamW, the full model trained."""
    return not numerics_changes(tech)


def numerics_note(tech: Mapping[str, Any]) -> str:
    """One line for a table cell."""
    notes = numerics_changes(tech)
    return "; ".join(notes) if notes else "standard (same math; rounding order only)"


def numerics_key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    """Rows with equal keys compute the same function in exact arithmetic: they differ only in
    kernels, recomputation or loss chunking, so their PPL differences measure rounding noise."""
    tech = config.get("technique", {})
    # Vocabulary padding is left out: padded rows are never used, so it changes no result.
    return (tech.get("precision"), tech.get("optim"), tech.get("window"), tech.get("lora_rank"))
