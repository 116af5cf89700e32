"""The CUDA caching-allocator model (memtrain.analysis.allocator) on synthetic timelines, and its place
in `estimate`. CPU-only: the constants are PyTorch's (CUDACachingAllocator.cpp); a GPU check of
the whole model is benchmarks/allocator_check.py."""

from __future__ import annotations

import pytest

from memtrain.analysis.allocator import CachingAllocator, MiB, replay, round_size
from memtrain.analysis.estimate import estimate
from memtrain.config import ConfigError, RunConfig


def test_rounding_to_512_bytes():
    assert [round_size(n) for n in (1, 511, 512, 513, 4096, 4097)] == [512, 512, 512, 1024, 4096, 4608]


def test_small_requests_share_a_2_mib_segment():
    a = CachingAllocator()
    hs = [a.malloc(1000) for _ in range(100)]  # 100 x 1024 B blocks
    assert a.reserved == 2 * MiB and a.segments_created == 1
    assert a.allocated == 100 * 1024
    a.malloc(1 * MiB)  # 1 MiB is still "small"; 2 MiB - 100 KiB left is enough
    assert a.segments_created == 1
    a.malloc(1 * MiB)  # no room left: a second small segment
    assert a.reserved == 4 * MiB
    for h in hs:
        a.free(h)
    assert a.reserved == 4 * MiB  # freed blocks stay cached


def test_large_requests_get_20_mib_segments_below_10_mib_and_2_mib_rounding_above():
    a = CachingAllocator()
    a.malloc(3 * MiB)
    assert a.reserved == 20 * MiB
    a.malloc(5 * MiB)  # fits in the remaining 17 MiB of the first segment
    assert a.reserved == 20 * MiB
    a.malloc(11 * MiB + 1)  # the 12 MiB left in the segment fit it
    assert a.reserved == 20 * MiB
    a.malloc(13 * MiB + 1)  # >= 10 MiB and no cached block fits: own segment, 2 MiB multiple
    assert a.reserved == 20 * MiB + 14 * MiB
    # A large block is split only when more than 1 MiB would remain: both requests keep the
    # whole block (12 MiB, 14 MiB), and allocated_bytes counts block sizes.
    assert a.peak_allocated == 3 * MiB + 5 * MiB + 12 * MiB + 14 * MiB


def test_freed_blocks_merge_and_are_reused_best_fit():
    a = CachingAllocator()
    h1, h2, h3 = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(4 * MiB)
    assert a.reserved == 20 * MiB
    a.free(h1)
    a.free(h2)  # merges with h1's block: one free 8 MiB block at the segment start
    a.malloc(7 * MiB)  # fits in the merged block: no new segment
    assert a.reserved == 20 * MiB
    a.free(h3)


def test_fragmentation_makes_reserved_exceed_allocated():
    """Interleaved lifetimes leave holes no larger request fits in: reserved > peak allocated."""
    a = CachingAllocator()
    keep = []
    for _ in range(10):
        h = a.malloc(6 * MiB)
        keep.append(a.malloc(6 * MiB))
        a.free(h)
    before = a.reserved
    assert before - a.allocated >= 15 * MiB  # enough cached bytes in total, but in holes
    a.malloc(15 * MiB)
    assert a.reserved == before + 16 * MiB  # so a new segment


def test_replay_adds_workspace_and_context():
    events = [("alloc", 1, 100 * MiB), ("alloc", 2, 1000), ("free", 1, 0), ("alloc", 3, 50 * MiB), ("free", 2, 0)]
    m = replay(events, "NVIDIA H100 80GB HBM3", tracked_peak=100 * MiB + 1000)
    assert m.gpu == "h100" and m.cublas_workspace == 32 * MiB
    assert m.allocated == 100 * MiB + 1024 + m.cublas_workspace
    # Segments: the 32 MiB workspace, 100 MiB, a 2 MiB small one; 50 MiB reuses the freed 100 MiB.
    assert m.reserved == 32 * MiB + 100 * MiB + 2 * MiB
    assert m.device_total == m.reserved + m.cuda_context
    assert any("assumed" in s for s in m.assumptions)


def test_estimate_reports_allocated_reserved_and_device_total():
    cfg = RunConfig().replace(vocab_size=512, d_model=64, n_heads=4, n_layers=6, d_ff=256, batch_size=4, seq_len=64)
    plain = estimate(cfg, device_type="cuda")
    est = estimate(cfg, device_type="cuda", gpu="a100")
    assert plain.device_memory is None and plain.to_dict()["device_memory"] is None
    dm = est.to_dict()["device_memory"]
    assert est.peak_bytes == plain.peak_bytes  # the per-layer timeline, same answer
    assert dm["tracked_peak"] <= dm["allocated"] <= dm["reserved"] < dm["device_total"]
    # Rounding and the workspace only: allocated stays close to the tracked peak here.
    assert dm["allocated"] - dm["tracked_peak"] < dm["cublas_workspace"] + 1 * MiB
    with pytest.raises(ConfigError, match="1024"):
        estimate(cfg.replace(n_layers=2000), device_type="cuda", gpu="a100")
