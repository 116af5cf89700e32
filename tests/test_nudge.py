"""The noise twins' nudge: every initial weight one rounding of its dtype away, reproducible from
the nudge seed, leaving the run's own random streams (dropout, batch order) where they were."""

from __future__ import annotations

import pytest
import torch

import memtrain.training.train as train_module
from conftest import TINY_MODEL
from memtrain.config.run import ConfigError, build_config
from memtrain.models.families import build_model
from memtrain.training.nudge import nudge_weights
from memtrain.training.train import train


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(build_config({**TINY_MODEL, "vocab_size": 97, "seq_len": 32})).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_weight_moves_by_about_one_rounding_of_its_dtype(dtype):
    plain, nudged = _model(dtype), _model(dtype)
    rng = torch.get_rng_state()
    changed = nudge_weights(nudged, 1)
    assert torch.equal(torch.get_rng_state(), rng)  # the run's own random streams are untouched
    eps = torch.finfo(dtype).eps
    total = 0
    for (name, a), b in zip(plain.named_parameters(), nudged.parameters()):
        assert torch.equal(b[a == 0], a[a == 0]), name  # a zero (a fresh bias) stays zero: a relative nudge
        rel = ((b.float() - a.float()).abs() / a.float().abs())[a != 0]
        assert rel.numel() == 0 or rel.max() <= 6 * eps, name  # one rounding of a ~N(0, 1) draw, not a new weight
        total += a.numel()
    # Most elements move (|z| eps rounds to a neighbour unless |z| is small), not all.
    assert 0.3 * total < changed < total


def test_the_nudge_seed_picks_the_draw():
    a, b, c = _model(), _model(), _model()
    nudge_weights(a, 1), nudge_weights(b, 1), nudge_weights(c, 2)
    same = all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    other = any(not torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    assert same and other


def test_a_run_with_a_nudge_seed_nudges_its_built_model_once(tiny_run, tmp_path, monkeypatch):
    """train nudges the model it built (before any technique wraps it) with the run's nudge seed,
    and only then; the twin then trains the same batches and stays close to the plain run (on
    this tiny model within float32 rounding of its losses), far closer than another seed."""
    calls = []

    def spy(model, seed):
        calls.append((type(model).__name__, seed, nudge_weights(model, seed)))

    monkeypatch.setattr(train_module, "nudge_weights", spy)
    runs = {}
    for name, extra in {"plain": {}, "nudge1": {"nudge_seed": 1}, "seed": {"seed": 1338}}.items():
        runs[name] = train(build_config({**tiny_run, **extra, "out": str(tmp_path / name)}), track_memory=False)
    assert [(kind, seed) for kind, seed, _ in calls] == [("GPT", 1)] and calls[0][2] > 0
    plain, nudged, other = (runs[n]["loss_history"] for n in ("plain", "nudge1", "seed"))
    assert max(abs(a - b) for a, b in zip(plain, nudged)) < 1e-4 < max(abs(a - b) for a, b in zip(plain, other))
    assert runs["nudge1"]["config"]["train"]["nudge_seed"] == 1


def test_nudge_seed_outside_its_range_is_refused():
    with pytest.raises(ConfigError, match=r"--nudge-seed must be in \[0, 2\*\*32\)"):
        build_config({"nudge_seed": -1})
