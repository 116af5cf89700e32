"""Nudge a model's initial weights by one rounding: the perturbation behind a bench's noise twins.

Two bench rows that share a seed (initial weights, batch order, validation blocks) and compute
the same thing in another order (checkpointing's recompute, a fused attention kernel, a chunked
loss) still end with different perplexities: a rounding-size difference in one step grows over
the following ones. A noise twin (bench row ``X-nudgeN``) is row ``X`` with every initial weight
moved by about one unit in the last place of its dtype; how far that carries the run is the
yardstick a technique's own PPL difference is measured against (``memtrain.report.noise``).

The draw comes from a private generator on the weights' device, seeded with the nudge seed: it
does not move the global RNG the run's dropout and batch order read, and it runs where the
weights are (an 8B model's normal draws on the CPU would take a minute). Its values are those of
that device's generator: a twin is reproducible on one kind of device, not across kinds.
"""

from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["nudge_weights"]


@torch.no_grad()
def nudge_weights(model: nn.Module, nudge_seed: int) -> int:
    """Multiply each floating-point weight of ``model`` in place by ``1 + eps * z`` (``eps`` the
    machine epsilon of the weight's dtype, ``z`` standard normal, drawn per element with
    ``nudge_seed``); return how many elements changed. Quantized or non-float weights (NF4, int8)
    and tensor subclasses are left as they are: their rounding is not one ulp of a float."""
    generators: dict[torch.device, torch.Generator] = {}
    changed = 0
    for param in model.parameters():
        if not param.is_floating_point() or type(param.data) is not torch.Tensor:
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(nudge_seed)
        eps = torch.finfo(param.dtype).eps
        z = torch.randn(param.shape, generator=gen, dtype=torch.float32, device=param.device)
        # In float32 then rounded once into the weight's dtype: the nudge is that one rounding.
        nudged = (param.float() * (1 + eps * z)).to(param.dtype)
        changed += int((nudged != param).sum())
        param.copy_(nudged)
    return changed
