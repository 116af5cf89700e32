"""A rank that fails on purpose (tests of failure propagation only)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
import torch.nn as nn

# Fault injection for the failure-propagation test: "R" or "R:K" makes rank R raise at its
# K-th forward call (default 2, i.e. after the first step's collectives have run).
FAIL_ENV = "MEMTRAIN_TEST_FAIL_RANK"


def _install_fault_injection(model: nn.Module) -> None:
    """If ``MEMTRAIN_TEST_FAIL_RANK`` names this rank, raise at its K-th forward (tests only)."""
    spec = os.environ.get(FAIL_ENV)
    if not spec:
        return
    rank_text, _, call_text = spec.partition(":")
    if int(rank_text) != dist.get_rank():
        return
    fail_at = int(call_text or 2)
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1
        if calls[0] >= fail_at:
            raise RuntimeError(f"injected failure on rank {dist.get_rank()} at forward {calls[0]} ({FAIL_ENV}={spec})")

    model.register_forward_pre_hook(hook)
