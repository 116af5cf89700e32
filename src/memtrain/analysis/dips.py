"""Searching the largest batch that fits: grow, bisect, and look past a non-monotone peak.

The caching-allocator model's device total is not monotone in the batch: batch 32 of memtrain's
GPT (bf16, SDPA, seq 256) is modelled at 6.33 GiB where batch 31 is 7.64 GiB, and batch 41 below
batch 40 (``step_need`` on the default card; tests/test_maxbatch_dips.py). A bisection assumes a
monotone peak: on a spike it stops below the largest batch that fits (maxbatch's CUDA
model answered 39 under 8 GiB where 41 fits). Every answer a bisection gives was itself probed and
fits; it can only be too small. :func:`climb_past_dips` looks a few batches past it. The same holds
for the length (``fit.longest_context``, which climbs the same way): Llama-3-8B LoRA on an RTX 4090
is modelled lower at 8,256 tokens than at 8,192 (tests/test_longest_context.py).
"""

from __future__ import annotations

from typing import Callable

# How many batches above an answer are probed: the spikes seen in the allocator model are one or
# two batches wide (tests/test_maxbatch_dips.py); a wider one goes unseen.
DIP_WINDOW = 4


def bisect_fitting(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest k in [lo, hi) with ``fits(k)``, given that ``lo`` fits, ``hi`` does not and
    fitting is monotone."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def largest_fitting(fits: Callable[[int], bool], cap: int) -> int:
    """The largest k in [1, cap] with ``fits(k)``, given that 1 fits and fitting is monotone:
    grow geometrically until a k fails or the cap is reached, then bisect between the last fit
    and the first failure."""
    lo, hi = 1, None  # lo fits; hi (when known) does not
    while hi is None and lo < cap:
        k = min(lo * 2, cap)
        if fits(k):
            lo = k
        else:
            hi = k
    return lo if hi is None else bisect_fitting(fits, lo, hi)


def climb_past_dips(fits: Callable[[int], bool], found: int, cap: int, window: int = DIP_WINDOW) -> int:
    """The answer ``found`` of a monotone search (it fits), raised to the largest of the
    ``window`` values above it that fits, then searched again from there (doubling steps, then
    bisect), until no value within ``window`` above the answer fits; never above ``cap``."""
    k = found
    while k < cap:
        above = next((j for j in range(min(k + window, cap), k, -1) if fits(j)), None)
        if above is None:
            return k
        k = grow_from(fits, above, cap)
    return k


def grow_from(fits: Callable[[int], bool], lo: int, cap: int) -> int:
    """The largest k in [lo, cap] found by doubling steps up from ``lo`` (which fits), then bisecting."""
    step, hi = 1, None
    while hi is None and lo < cap:
        k = min(lo + step, cap)
        if fits(k):
            lo, step = k, step * 2
        else:
            hi = k
    return lo if hi is None else bisect_fitting(fits, lo, hi)
