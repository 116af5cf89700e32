"""The step loop's feed: the next group of batches fetched while a step runs (on a GPU) changes
nothing about which batches a run sees or where a checkpoint resumes, and the fetch happens
where the host would wait for the device: after the step's work is queued."""

from __future__ import annotations

import functools
import inspect

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
    got = []
    for _ in range(15):
        got.append(feed.next_group(group))
        feed.prefetch(group)  # as the step loop does while the step runs
    feed.close()
    assert len(got) == 15 and all(_same(g, e) for g, e in zip(got, expected))


def test_the_position_is_after_the_groups_handed_out_not_the_one_fetched_ahead():
    plain = _loader()
    feed = DeviceFeed(_loader(), CPU, ahead=True)
    for i in range(1, 12):
        feed.next_group(2)
        feed.prefetch(2)
        for _ in range(2):
            plain.next_batch()
        assert feed._ready is not None and feed.state_dict() == plain.state_dict(), i  # one group is ahead
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
    first = feed.next_group(1)
    feed.prefetch(1)
    got = first + feed.next_group(3)  # the group fetched ahead had size 1
    feed.close()
    assert len(got) == 4 and _same(got, expected)


def test_closing_puts_the_loader_back_where_the_caller_stands():
    """A group fetched ahead and never handed out (the run's last step) is not a position."""
    feed = DeviceFeed(_loader(), CPU, ahead=True)
    feed.next_group(2)
    feed.prefetch(2)
    feed.close()
    assert feed.state_dict() == feed.loader.state_dict() == {"epoch": 0, "batch_index": 2}


def test_on_cpu_the_feed_fetches_on_demand():
    feed = DeviceFeed(_loader(), CPU)
    assert not feed.ahead
    feed.next_group(2)
    feed.prefetch(2)
    assert feed._ready is None and feed.state_dict() == feed.loader.state_dict() == {"epoch": 0, "batch_index": 2}


def test_a_run_fetching_ahead_resumes_exactly(tiny_run, tmp_path, monkeypatch):
    """The whole loop fetching ahead (as on a GPU): stop, save, resume, and get the losses of
    one uninterrupted run (a checkpoint written while a group is fetched ahead)."""
    monkeypatch.setattr(train_module, "DeviceFeed", functools.partial(DeviceFeed, ahead=True))
    base = {**tiny_run, "steps": 8, "dropout": 0.1, "grad_accum": 2}
    full = train(build_config(base))
    half = train(build_config({**base, "stop_after": 4, "save": str(tmp_path / "half.pt")}))
    assert half["loss_history"] == full["loss_history"][:4]
    resumed = train(build_config({**base, "resume": str(tmp_path / "half.pt")}))
    assert resumed["loss_history"] == full["loss_history"]


def test_the_loop_fetches_while_each_unmetered_step_runs(tiny_run, monkeypatch):
    """The next group is fetched once per unmetered step, after that step's optimizer step is
    queued and before its loss is read (``train_step``'s ``before_wait``); a metered step
    fetches nothing, so the meter sees only the step's own tensors."""
    calls: list[tuple[int, bool]] = []  # (optimizer steps taken so far, called from inside train_step)
    feeds: list[DeviceFeed] = []
    real_prefetch = DeviceFeed.prefetch
    real_step = torch.optim.AdamW.step

    def counting_step(self, *a, **k):
        counting_step.n += 1
        return real_step(self, *a, **k)

    counting_step.n = 0

    def spy(self, group):
        calls.append((counting_step.n, any(f.function == "train_step" for f in inspect.stack())))
        feeds.append(self)
        return real_prefetch(self, group)

    monkeypatch.setattr(DeviceFeed, "prefetch", spy)
    monkeypatch.setattr(torch.optim.AdamW, "step", counting_step)
    monkeypatch.setattr(train_module, "DeviceFeed", functools.partial(DeviceFeed, ahead=True))
    result = train(build_config({**tiny_run, "steps": 6, "grad_accum": 2}))
    metered = len(train_module.METERED_STEPS)
    assert result["steps_run"] == 6
    # Step i (0-based) fetches after its own optimizer step: i + 1 steps taken.
    assert calls == [(i + 1, True) for i in range(metered, 6)]
    assert feeds[0]._ready is None  # the last group fetched ahead was dropped when the run ended


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_feed_fetches_ahead_into_pinned_memory_and_copies_to_the_device():
    cuda = torch.device("cuda")
    feed = DeviceFeed(_loader(), cuda)
    assert feed.ahead
    first = feed.next_group(2)
    feed.prefetch(2)
    assert all(x.is_pinned() and y.is_pinned() for x, y in feed._ready)
    second = feed.next_group(2)
    feed.close()
    torch.cuda.synchronize()
    expected = _plain_groups(2, 2)
    assert all(x.device.type == "cuda" for x, _ in first + second)
    assert _same([(x.cpu(), y.cpu()) for x, y in first + second], expected[0] + expected[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_run_fetching_ahead_resumes_exactly(tiny_text_run, tmp_path):
    base = {**tiny_text_run, "steps": 8, "grad_accum": 2, "device": "cuda"}
    full = train(build_config(base))
    half = train(build_config({**base, "stop_after": 4, "save": str(tmp_path / "half.pt")}))
    resumed = train(build_config({**base, "resume": str(tmp_path / "half.pt")}))
    torch.testing.assert_close(resumed["loss_history"], full["loss_history"], rtol=1e-5, atol=1e-5)
    assert half["loss_history"] == resumed["loss_history"][:4]
