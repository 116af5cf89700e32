"""`plan --max-batch` on a transformers model traces a bounded number of candidates.

Every set's bisection was traced near the limit, plus four probes past each answer looking for
the allocator model's dips (which a tensor trace has not): `plan --max-batch --model tiny-llama
--memory-budget 8GiB` ran for over 13 minutes on 2 CPU cores (a chunked-loss trace at a few
hundred sequences takes ~20 s). The trace here is the analytic model of the layers, so the test
counts calls and takes seconds."""

from __future__ import annotations

from typing import Any

import pytest

import memtrain.analysis.depth_trace as depth_trace
from memtrain.analysis.estimate import estimate
from memtrain.analysis.estimate.hf import modelled_arch
from memtrain.analysis.plan import MAX_BATCH_TRACES, plan
from memtrain.cli import main
from memtrain.config.run import RunConfig, build_config

GiB = 2**30


def _modelled_peak(cfg: RunConfig) -> float:
    arch = modelled_arch(cfg, "cpu")
    assert arch is not None  # tiny-llama's family is one the analytic model claims
    return estimate(cfg, arch, "cpu").peak_bytes


@pytest.fixture
def traced(monkeypatch) -> list[int]:
    """Each traced batch, in order; the 'trace' is the analytic model's peak (milliseconds)."""
    batches: list[int] = []

    def fake_trace(cfg: RunConfig, device_type: str = "cpu", full: bool = False) -> dict[str, Any]:
        batches.append(cfg.train.batch_size)
        e = estimate(cfg, modelled_arch(cfg, device_type), device_type)
        return {"peak_bytes": e.peak_bytes, "peak_phase": e.peak_phase}

    monkeypatch.setattr(depth_trace, "trace_any_depth", fake_trace)
    return batches


def test_max_batch_traces_at_most_the_cap_and_every_answer_fits(traced):
    cfg = build_config({"model": "tiny-llama"})
    res = plan(cfg, 8 * GiB, "cpu", arch=None, max_batch=True, top=10**6)
    assert 0 < len(traced) <= MAX_BATCH_TRACES  # the old search traced 222 here
    limit = 8 * GiB / (1 + res.margin)
    assert len(res.candidates) == 32
    for c in res.candidates:
        assert c.peak_bytes <= limit
    assert any("trace cap reached (--max-traces, 8 traced)" in n for n in res.notes)


def test_the_fastest_set_is_raised_to_its_largest_batch(traced):
    cfg = build_config({"model": "tiny-llama"})
    space = {"precision": ["fp32"], "attention": ["sdpa"], "checkpointing": ["none"], "loss": ["standard"],
             "optim": ["adamw"]}
    res = plan(cfg, 8 * GiB, "cpu", arch=None, max_batch=True, space=space, max_traces=8)
    best = res.candidates[0]
    limit = 8 * GiB / (1 + res.margin)

    def at(b: int) -> RunConfig:
        return cfg.replace(**best.techniques, batch_size=b, grad_accum=1)

    assert _modelled_peak(at(best.batch_size)) <= limit < _modelled_peak(at(best.batch_size + 1))
    # The quick figure's own answer and the batch above it: two traces where it is right.
    assert len(traced) == 2 and not any("trace cap" in n for n in res.notes)


def test_max_traces_flag_caps_and_says_so(traced, capsys):
    assert main(["plan", "--max-batch", "--model", "tiny-llama", "--memory-budget", "8GiB", "--max-traces", "2",
                 "--checkpointings", "none", "--losses", "standard"]) == 0
    assert len(traced) <= 2
    assert "trace cap reached (--max-traces, 2 traced)" in capsys.readouterr().out
