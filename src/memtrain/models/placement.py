"""Moving a model to its device and weight dtype without touching what its library keeps apart.

``Module.to(dtype)`` casts every floating buffer with the parameters. transformers computes
rope's ``inv_freq`` in float32 whatever the weights' dtype (``from_config`` and
``from_pretrained`` with ``dtype=torch.bfloat16`` keep it so, and HF Trainer trains with it);
rounded to BF16 its frequencies are off by up to 0.4%, so every position but the first turns
by other angles than the library's own model would. Hand-written because torch has no
"parameters only" form of ``to``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn


def place_weights(model: nn.Module, dtype: Optional[torch.dtype], device: Optional[torch.device] = None) -> nn.Module:
    """``model``'s floating parameters cast to ``dtype`` (None: kept) and every parameter and
    buffer moved to ``device`` (None: kept), tensor by tensor, in place; buffers keep their
    dtype; a tied parameter (one object in two modules) stays one. Returns ``model``."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and dtype is not None:
                p.data = p.data.to(device=device, dtype=dtype)  # one copy, moved and cast together
            elif device is not None:
                p.data = p.data.to(device=device)
        if device is not None:
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device=device))
    return model
