"""The allocation timeline of a run's first two training steps, replayed through the CUDA
caching-allocator model (:mod:`memtrain.analysis.allocator`).

``torch.cuda.max_memory_reserved`` after the second (measured) step is not a property of that
step alone: the allocator never returns a segment, so ``reserved`` is the high-water mark of
*both* steps, and step 2 runs in the cache that step 1 left. Step 1 differs from the steady
state in the ways that shape that cache:

* the optimizer state does not exist yet; the first ``optimizer.step()`` creates it, tensor by
  tensor (AdamW: exp_avg, exp_avg_sq per parameter), in the blocks the backward just freed.
  Those blocks were the activations' segments, so in step 2 the activations no longer fit
  where they were and part of them needs new segments;
* the backward runs on the autograd engine's device thread, and cuBLAS handles (with their
  workspaces, one per handle and stream) are per thread: step 1's first backward matmul
  allocates a second workspace, which never goes. It lands in whatever block is free then, for
  the standard loss one of the float32 logits-sized blocks the loss's backward just freed, and
  splits it for good: on an H100, two steps of the seed GPT in BF16 at batch 64 x 256 reserved
  one more logits-sized segment in step 2 (16.68 GB, not 13.38;
  benchmarks/results/gpu-h100/runbook-2026-11-26, run 4), and every seed row's allocated peak
  was one workspace (32 MiB) above a model that had only the forward thread's;
* with ``--loss naive`` no previous step's logits are alive during step 1's forward; from
  step 2 on, the caller's ``logits`` of the last step lives until the new ones are returned,
  so the new ones need a second logits-sized block.

Between the steps, ``zero_grad(set_to_none=True)`` frees the gradients and the batch's
temporaries die; only the weights, the optimizer state and (naive loss) the caller's logits
carry over. The allocated peak is reset at step 2 (as ``measure_step_memory`` resets it), the
reserved figure is not (resetting it would not lower it: segments are all still cached).

The two step timelines come from the estimator's simulator (:func:`memtrain.analysis.estimate.estimate`,
its ``events``): the same storages, sizes and order its tracked peak is computed from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from memtrain.analysis.allocator import DeviceMemory, replay

__all__ = ["StepTimeline", "two_step_events", "replay_two_steps"]

Event = tuple[str, int, float]


@dataclass
class StepTimeline:
    """One simulated step: its (op, storage id, bytes) events and what frames them."""

    events: list[Event]
    optimizer_at: int  # index of the first event of the optimizer step
    state_sids: list[int]  # the weights (and optimizer state) lumps, allocated before the step
    carried_in: Optional[int] = None  # storage alive from the previous step (naive loss logits)
    live_at_end: dict[int, tuple[float, str]] = field(default_factory=dict)  # sid -> (bytes, tag)
    peak: float = 0.0
    # index of the event before which the backward's first matmul takes its workspace (None: no matmul)
    backward_gemm_at: Optional[int] = None


def _first_step_events(first: StepTimeline, lazy_state: list[float], a: Callable[[int], int]) -> list[Event]:
    """Step 1's events (ids through ``a``) with the backward thread's workspace and the lazily
    created optimizer state inserted where they happen."""
    inserts: dict[int, list[Event]] = {}
    if first.backward_gemm_at is not None:
        inserts.setdefault(first.backward_gemm_at, []).append(("workspace", 0, 0.0))
    # The first optimizer.step() creates the state (lazily, per tensor).
    inserts.setdefault(first.optimizer_at, []).extend(("alloc", -1 - j, nbytes) for j, nbytes in enumerate(lazy_state))
    skip = set(first.state_sids)
    out: list[Event] = []
    for i, (op, sid, nbytes) in enumerate(first.events):
        out += inserts.pop(i, [])
        if sid not in skip:
            out.append((op, a(sid), nbytes))
    for i in sorted(inserts):  # at or past the end
        out += inserts[i]
    return out


def two_step_events(first: StepTimeline, steady: StepTimeline, lazy_state: Iterable[float]) -> list[Event]:
    """One event stream for step 1 then step 2 (ids made distinct), with the optimizer state
    created at step 1's optimizer step, ``("workspace", 0, 0)`` where step 1's backward thread
    creates its cuBLAS workspace and ``("reset_peak", 0, 0)`` where step 2 starts."""

    def a(sid: int) -> int:  # step 1's ids
        return 2 * sid

    def b(sid: int) -> int:  # step 2's ids
        return 2 * sid + 1

    out = _first_step_events(first, list(lazy_state), a)
    skip1 = set(first.state_sids)
    # End of step 1: zero_grad(set_to_none) frees the gradients, the step's temporaries are
    # gone; the weights and (naive loss) the caller's logits stay.
    carried: Optional[int] = None
    for sid, (_, tag) in first.live_at_end.items():
        if sid in skip1:
            continue
        if tag == "logits" and steady.carried_in is not None and carried is None:
            carried = sid
            continue
        out.append(("free", a(sid), 0.0))
    out.append(("reset_peak", 0, 0.0))
    skip2 = set(steady.state_sids)
    for op, sid, nbytes in steady.events:
        if sid in skip2:
            continue
        if sid == steady.carried_in:
            if op == "free" and carried is not None:
                out.append(("free", a(carried), 0.0))
            continue
        out.append((op, b(sid), nbytes))
    return out


def replay_two_steps(first: StepTimeline, steady: StepTimeline, gpu: Optional[str], weights: list[float],
                     lazy_state: list[float]) -> DeviceMemory:
    """Allocated (step 2's peak), reserved (both steps) and device total of a training run's
    measured step, from the estimator's two step timelines. ``weights``: the parameters'
    sizes, allocated tensor by tensor when the model is moved to the GPU."""
    events = two_step_events(first, steady, lazy_state)
    dm = replay(events, gpu, steady.peak, weights)
    dm.assumptions.append("two steps replayed: step 1 creates the optimizer state after its backward and, at its "
                          "first backward matmul, the autograd thread's cuBLAS workspace; allocated is step 2's "
                          "peak, reserved the high-water mark of both")
    return dm
