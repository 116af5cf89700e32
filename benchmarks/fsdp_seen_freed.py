"""`memtrain train` with the tracked meter told of FSDP2's storage resizes: what a rank really holds.

FSDP2 frees a group's gathered (unsharded) weights by shrinking their storage in place
(``untyped_storage().resize_(0)``, in ``torch.distributed.fsdp._fully_shard._fsdp_param.free_storage``)
and grows it back the same way before the next all-gather. Neither is an operator, so the tracked
meter (``memtrain.metrics.MemoryMeter``) never sees them: under ``--distributed zero2|fsdp`` a
rank's tracked ``peak_bytes`` counts gathered weights FSDP2 already freed. This script wraps those
two functions so that every active meter books the new size at once, then runs ``memtrain train``
with the given arguments. It is a measuring tool for the per-rank estimate (docs/distributed.md,
tests/test_estimate_fsdp_grads.py), not part of memtrain: it patches torch's internals.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/fsdp_seen_freed.py \\
        --d-model 128 --n-heads 4 --n-layers 12 --d-ff 4096 --seq-len 32 --batch-size 2 --dropout 0 \\
        --steps 3 --warmup-steps 1 --val-blocks 2 --no-progress --distributed zero2 --out runs/seen-freed

Each rank's peak is then ``ranks[i].peak_bytes`` in ``OUT/result.json``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

import memtrain.metrics.memory as memory

_ACTIVE: list[Any] = []  # the meters inside their ``with`` block
_enter, _exit = memory.MemoryMeter.__enter__, memory.MemoryMeter.__exit__


def _entering(meter: Any) -> Any:
    _ACTIVE.append(meter)
    return _enter(meter)


def _leaving(meter: Any, *exc: Any) -> None:
    _ACTIVE.remove(meter)
    _exit(meter, *exc)


def _told(resize: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``resize``, then every active meter books the storage's new size (if it counts it)."""

    def resized(tensor: torch.Tensor) -> None:
        resize(tensor)
        storage = tensor.untyped_storage()
        for meter in _ACTIVE:
            record = meter._records.get(id(storage))
            if record is not None and storage.nbytes() != record.nbytes:
                meter._resized(record, storage.nbytes())
                meter._check_peak()

    return resized


def main() -> int:
    memory.MemoryMeter.__enter__ = _entering  # type: ignore[method-assign]
    memory.MemoryMeter.__exit__ = _leaving  # type: ignore[method-assign]
    fsdp_param.free_storage = _told(fsdp_param.free_storage)
    fsdp_param.alloc_storage = _told(fsdp_param.alloc_storage)
    from memtrain.cli import main as memtrain_main  # after the patches: the CLI imports the meter's users

    return memtrain_main(["train", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
