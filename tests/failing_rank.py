"""A ``memtrain`` rank that fails on purpose, for tests of failure propagation (tests/test_distributed.py).

    torchrun --nproc_per_node 2 tests/failing_rank.py R[:K] train ARGS...

Rank R raises at its K-th forward of the model (default 2: after the first step's collectives
have run); every rank otherwise runs ``memtrain.cli.main(ARGS)``, what ``python -m memtrain`` runs.
The failure comes from a global forward pre-hook (torch's
``register_module_forward_pre_hook``), so memtrain itself carries no test code.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook

import memtrain.cli
from memtrain.models.gpt import GPT


def fail_at_forward(spec: str) -> None:
    """From now on, rank R of ``spec`` ("R" or "R:K") raises at its K-th forward of a GPT."""
    rank_text, _, call_text = spec.partition(":")
    rank, fail_at = int(rank_text), int(call_text or 2)
    calls = [0]

    def hook(module: nn.Module, _: Any) -> None:
        if not isinstance(module, GPT) or not dist.is_initialized() or dist.get_rank() != rank:
            return
        calls[0] += 1
        if calls[0] >= fail_at:
            raise RuntimeError(f"injected failure on rank {rank} at forward {calls[0]} (failing_rank.py {spec})")

    register_module_forward_pre_hook(hook)


if __name__ == "__main__":
    fail_at_forward(sys.argv[1])
    sys.exit(memtrain.cli.main(sys.argv[2:]))
