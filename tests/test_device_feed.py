"""The step loop's feed: the next group of batches fetched ahead (on a GPU) changes nothing
about which batches a run sees or where a checkpoint resumes."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import memtrain.training.train as train_module
from memtrain.config.run import build_config
from memtrain.data import make_train_loader
from memtrain.data.device_feed import DeviceFeed
from memtrain.training.train import train

CPU = torch.device("cpu")
TOKENS = np.arange(5000, dtype=np.uint16) % 997


def _loader():
    return make_train_loader(TOKENS, seq_len=16, batch_size=4, seed=3)  # 73 blocks: 18 batches an epoch


def _plain_groups(n_groups: int, group: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    loader = _loader()
    return [[loader.next_batch() for _ in range(group)] for _ in range(n_groups)]


def _same(a, b) -> bool:
    return all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


@pytest.mark.parametrize("group", [1, 3])
def test_fetching_ahead_yields_the_plain_loaders_batches(group):
    """Across an epoch boundary (18 batches an epoch), with grad-accumulation groups."""
    expected = _plain_groups(15, group)
    feed = DeviceFeed(_loader(), CPU, ahead=True)
    try:
        got = [feed.next_group(group) for _ in range(15)]
    finally:
        feed.close()
    assert all(_same(g, e) for g, e in zip(got, expected))


def test_the_position_is_after_the_groups_handed_out_not_the_one_fetched_ahead():
    plain = _loader()
    feed = DeviceFeed(_loader(), CPU, ahead=True)
    for i in range(1, 12):
        feed.next_group(2)
        for _ in range(2):
            plain.next_batch()
        assert feed.state_dict() == plain.state_dict(), i  # a group is in flight meanwhile
    saved = feed.state_dict()
    following = feed.next_group(2)
    resumed = DeviceFeed(_loader(), CPU, ahead=True)
    resumed.load_state_dict(saved)
    assert _same(resumed.next_group(2), following)
    feed.close()
    resumed.close()


def test_a_changed_group_size_refetches_from_the_right_place():
    expected = [b for g in _plain_groups(4, 1) for b in g]
    feed = DeviceFeed(_loader(), CPU, ahead=True)
    got = feed.next_group(1) + feed.next_group(3)  # the group fetched ahead had size 1
    feed.close()
    assert _same(got, expected)


def test_on_cpu_the_feed_fetches_on_demand():
    feed = DeviceFeed(_loader(), CPU)
    assert not feed.ahead
    feed.next_group(2)
    assert feed._pending is None and feed.state_dict() == {"epoch": 0, "batch_index": 2}


def test_a_run_fetching_ahead_resumes_exactly(tiny_run, tmp_path, monkeypatch):
    """The whole loop with the background fetch on (as on a GPU): stop, save, resume, and get
    the losses of one uninterrupted run (a checkpoint written while a group is in flight)."""
    monkeypatch.setattr(train_module, "DeviceFeed", functools.partial(DeviceFeed, ahead=True))
    base = {**tiny_run, "steps": 8, "dropout": 0.1, "grad_accum": 2}
    full = train(build_config(base))
    half = train(build_config({**base, "stop_after": 4, "save": str(tmp_path / "half.pt")}))
    assert half["loss_history"] == full["loss_history"][:4]
    resumed = train(build_config({**base, "resume": str(tmp_path / "half.pt")}))
    assert resumed["loss_history"] == full["loss_history"]
