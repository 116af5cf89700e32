"""Memory techniques, each a function applied to a finished model in one documented order:

    lora -> attention backend -> activation checkpointing -> loss -> compile -> distributed wrap

Why this order: LoRA swaps Linear modules, so it must run before anything captures them;
the attention backend and the loss are plain attribute swaps on the model's seams;
checkpointing wraps whole blocks (so it sees the final attention and LoRA modules);
compile traces what all of those built; the distributed wrap shards the final modules.

``prepare_model`` runs that order; ``build_optimizer`` runs afterwards because it must see the
final set of trainable parameters (only the adapters under LoRA).

What each technique *is*, as typed values parsed once (``CheckpointPolicy``, the precision
dtypes, the optimizer state rule), lives in :mod:`memtrain.techniques.facts`, which imports no
torch: the analytic commands (estimate, flops rules, plan) read it without loading torch, so
this package resolves its torch-side names (``prepare_model`` ...) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from memtrain.techniques.optim import build_optimizer
    from memtrain.techniques.order import prepare_model
    from memtrain.techniques.precision import Precision, make_precision

__all__ = ["prepare_model", "build_optimizer", "make_precision", "Precision"]

# Resolved on first use (PEP 562), so `import memtrain.techniques.facts` loads no torch.
_LAZY = {"prepare_model": "order", "build_optimizer": "optim", "make_precision": "precision",
         "Precision": "precision"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"memtrain.techniques.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'memtrain.techniques' has no attribute {name!r}")
