"""``--compile-memory-budget F`` without a trace: a straight line between two analytic estimates.

torch's partitioner saves, above the compiled graph's inputs, at most F of what it saves by
default (``torch._functorch.config.activation_memory_budget``), recomputing the ops that free
the most bytes per FLOP. Which ops those are depends on the graph and on torch's runtime
estimate, so no analytic rule gives the bytes; ``memtrain estimate --trace`` runs the
partitioner (:mod:`memtrain.analysis.compile_trace`). This module is the cheap stand-in, and it
says so wherever it is shown (``method: "interpolated"``):

* the ends: F = 1 is the step without checkpointing (the default partition, taken as what eager
  saves); F -> 0 is full checkpointing (every block keeps only its input, which is what the
  partition keeps of a block-scope graph; a model-scope graph may keep less);
* between them, bytes by category and the peak on the line
  ``full + F x (none - full)``; the knapsack keeps the saved bytes *under* F of the default,
  so the line is an upper bound where the ends are right;
* recomputation: ``(1 - F)`` x what full checkpointing recomputes (one more forward of the
  blocks). The knapsack recomputes the cheapest bytes first, so this also errs high.

With activation checkpointing on as well, the budget acts on what checkpointing leaves and the
line does not apply: :func:`interpolated_budget` then says so and gives no figure.
"""

from __future__ import annotations

from typing import Any, Optional

from memtrain.analysis.estimate.training import estimate
from memtrain.config.archs import GPT2_ARCH, Arch
from memtrain.config.run import RunConfig

__all__ = ["INTERPOLATION_NOTE", "interpolate", "interpolated_budget", "recompute_share"]

INTERPOLATION_NOTE = ("interpolated between no checkpointing (budget 1) and full checkpointing (budget 0), "
                      "not traced; --trace runs torch's partitioner")


def interpolate(full: float, none: float, budget: float) -> float:
    """The point at ``budget`` on the line from full checkpointing (0) to none (1)."""
    return full + budget * (none - full)


def recompute_share(budget: float) -> float:
    """Share of full checkpointing's recomputation charged to ``budget`` (see the module docstring)."""
    return 1.0 - budget


def interpolated_budget(cfg: RunConfig, arch: Arch = GPT2_ARCH, device_type: Optional[str] = None,
                        **estimate_kw: Any) -> Optional[dict[str, Any]]:
    """The ``compile_memory_budget`` entry of an analytic estimate of ``cfg``; None without a budget.

    ``estimate_kw`` reach :func:`memtrain.analysis.estimate.estimate` (world size, sharding, GPU)."""
    budget = cfg.technique.compile_memory_budget
    if budget is None:
        return None
    entry: dict[str, Any] = {"memory_budget": budget, "method": "interpolated", "note": INTERPOLATION_NOTE}
    if cfg.technique.checkpointing != "none":
        entry.update(method=None, note="not modelled with --checkpointing on: the budget acts on what "
                                       "checkpointing leaves; --trace runs torch's partitioner")
        return entry
    ends = {c: estimate(cfg.replace(checkpointing=c), arch, device_type, **estimate_kw) for c in ("full", "none")}
    full, none = ends["full"], ends["none"]
    entry.update(
        peak_bytes=int(round(interpolate(full.peak_bytes, none.peak_bytes, budget))),
        by_category={k: int(round(interpolate(full.by_category[k], none.by_category[k], budget)))
                     for k in none.by_category},
        recompute_share=recompute_share(budget),
    )
    if full.device_memory and none.device_memory:  # --gpu: what the card holds, on the same line
        entry["device_total"] = int(round(interpolate(full.device_memory["device_total"],
                                                      none.device_memory["device_total"], budget)))
    return entry
