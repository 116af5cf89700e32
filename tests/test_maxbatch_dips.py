"""The largest batch that fits when the modelled peak is not monotone in the batch.

The caching-allocator model's device total can fall as the batch grows (memtrain.analysis.dips);
a bisection then stopped below the largest batch that fits. Every answer is still a batch that
was modelled and fits; now none within DIP_WINDOW batches above it fits either.
"""

from __future__ import annotations

import json
import random

import pytest

from memtrain.analysis.dips import DIP_WINDOW, climb_past_dips, grow_from, largest_fitting
from memtrain.analysis.fit import largest_batch, step_need
from memtrain.analysis.maxbatch import analytic_arch, estimated_max_batch
from memtrain.cli import main
from memtrain.config.run import build_config

GiB = 1 << 30


def _spiked(k: int) -> bool:
    """Fits up to 50, but batch 48 is a spike (its modelled peak over the budget)."""
    return k <= 50 and k != 48


def test_a_spike_stops_the_bisection_short_and_the_climb_goes_past_it() -> None:
    assert largest_fitting(_spiked, 64) == 47  # the old answer: 49 and 50 fit
    assert climb_past_dips(_spiked, 47, 64) == 50
    assert climb_past_dips(_spiked, 47, 49) == 49  # never past the bound
    assert climb_past_dips(lambda k: k <= 50, 50, 64) == 50  # monotone: nothing changes


@pytest.mark.parametrize("cap", range(1, 12))
def test_the_searches_reach_the_cap_when_everything_fits(cap: int) -> None:
    assert largest_fitting(lambda k: True, cap) == cap
    assert grow_from(lambda k: True, 1, cap) == cap


def test_a_spike_one_narrower_than_the_window_is_climbed_and_one_as_wide_is_not() -> None:
    """DIP_WINDOW is 4 (the module's docstring: the spikes seen are one or two batches wide, so
    four leaves a margin): a spike of three batches above the answer is passed, one of four is
    where the search stops."""
    assert DIP_WINDOW == 4
    assert climb_past_dips(lambda k: k <= 50 and k not in (46, 47, 48), 45, 64) == 50
    assert climb_past_dips(lambda k: k <= 50 and k not in (46, 47, 48, 49), 45, 64) == 45


def test_grow_from_doubles_its_steps() -> None:
    """Each probe is an estimate (a traced step on a large model takes seconds): from 1 to an
    edge near a million the search takes about 2 log2(edge) probes, not a probe per batch."""
    probes: list[int] = []

    def fits(k: int) -> bool:
        probes.append(k)
        return k <= 600_000

    assert grow_from(fits, 1, 1 << 20) == 600_000
    assert len(probes) <= 2 * 20 + 2


@pytest.mark.parametrize("seed", range(20))
def test_the_answer_fits_and_nothing_fits_within_the_window_above(seed: int) -> None:
    rng = random.Random(seed)
    edge = rng.randint(2, 200)
    spikes = set(rng.sample(range(2, edge + 1), k=min(edge - 1, rng.randint(0, 8))))
    spikes = {s for s in spikes if not any(s - j in spikes for j in range(1, DIP_WINDOW))}  # spikes < window wide

    def fits(k: int) -> bool:
        return k <= edge and k not in spikes

    found = climb_past_dips(fits, largest_fitting(fits, 256), 256)
    assert found == max(k for k in range(1, 257) if fits(k))  # every spike is narrower than the window
    assert not any(fits(j) for j in range(found + 1, min(found + DIP_WINDOW, 256) + 1))


def test_largest_batch_goes_past_a_spike_of_the_need() -> None:
    cfg = build_config({}, {})
    calls: list[int] = []

    def need(c) -> float:
        calls.append(c.train.batch_size)
        return 1e12 if c.train.batch_size == 48 else float(c.train.batch_size)

    assert largest_batch(need, cfg, 50.0, cap=64) == 50  # it was 47
    assert len(calls) == len(set(calls))  # each batch modelled once


def _cuda_model_case():
    """memtrain's GPT in bf16 with SDPA at seq 256 under the CUDA model: batches 30-31 and 40 are
    modelled above batches 32 and 41."""
    cfg = build_config({}, {"precision": "bf16", "attention": "sdpa", "seq_len": 256})
    arch = analytic_arch(cfg)
    needs = {b: step_need(cfg.replace(batch_size=b), arch, "cuda", None)[0] for b in range(1, 65)}
    return cfg, needs


def test_maxbatch_by_the_cuda_model_finds_the_largest_batch_that_fits() -> None:
    cfg, needs = _cuda_model_case()
    assert any(needs[b + 1] < needs[b] for b in range(1, 64))  # the model is not monotone here
    for budget in (8 * GiB, int(8.5 * GiB)):
        largest = max(b for b, n in needs.items() if n <= budget)
        res = estimated_max_batch(cfg, budget, None, max_batch=64)
        assert res.batch_size == largest and res.peak_bytes <= budget  # 8 GiB: 39, now 41


def test_plan_max_batch_finds_the_largest_batch_that_fits(capsys) -> None:
    _, needs = _cuda_model_case()
    largest = max(b for b, n in needs.items() if n <= 8 * GiB)
    assert main(["plan", "--device-type", "cuda", "--budget", "8GiB", "--margin", "0", "--max-batch", "64",
                 "--precisions", "bf16", "--attentions", "sdpa", "--checkpointings", "none", "--losses", "standard",
                 "--optims", "adamw", "--json"]) == 0
    plain = [c for c in json.loads(capsys.readouterr().out)["candidates"]
             if not c["techniques"]["offload_activations"]]
    assert plain and plain[0]["batch_size"] == largest and plain[0]["peak_bytes"] <= 8 * GiB  # it was 39


def test_plan_micro_batch_goes_past_a_spike_among_the_divisors(monkeypatch, capsys) -> None:
    """--batch-size 40: the micro-batches searched are its divisors 40, 20, 10, 8, 5, 4, 2, 1. A
    peak with a spike at micro-batch 8 sent the bisection down to 5 where 10 and 20 fit."""
    import dataclasses

    import memtrain.analysis.plan as plan_module

    real = plan_module.estimate

    def spiked(c, *args, **kw):
        b = c.train.batch_size
        return dataclasses.replace(real(c, *args, **kw), peak_bytes=float(1 << 40 if b == 8 else b << 20))

    monkeypatch.setattr(plan_module, "estimate", spiked)
    assert main(["plan", "--device-type", "cpu", "--budget", "30MiB", "--margin", "0", "--batch-size", "40",
                 "--d-model", "32", "--n-heads", "2", "--n-layers", "2", "--d-ff", "64", "--seq-len", "32",
                 "--precisions", "fp32", "--attentions", "math", "--checkpointings", "none", "--losses", "standard",
                 "--optims", "adamw", "--json"]) == 0
    cands = json.loads(capsys.readouterr().out)["candidates"]
    assert cands and {(c["batch_size"], c["grad_accum"]) for c in cands} == {(20, 2)}  # it was (5, 8)


def test_largest_batch_counts_in_multiples() -> None:
    """--multiple-of 4 (a batch per rank times ranks): k counts multiples, the need is of k x 4."""
    cfg = build_config({}, {})
    asked: list[int] = []

    def need(c) -> float:
        asked.append(c.train.batch_size)
        return float(c.train.batch_size)

    assert largest_batch(need, cfg, 26.0, multiple_of=4, cap=64) == 6  # batch 24; 28 needs 28
    assert asked and all(b % 4 == 0 for b in asked)
