"""Gradient accumulation: N micro-batches give the large batch's update, with the memory of a
micro-batch."""

from __future__ import annotations

import copy

import torch

from memtrain.config.run import ModelConfig, build_config
from memtrain.metrics import MemoryMeter
from memtrain.models.gpt import GPT
from memtrain.techniques import build_optimizer, make_precision
from memtrain.training.step import train_step

CFG = dict(vocab_size=128, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_seq_len=32, dropout=0.0)


def _step(model, batches, clip):
    # SGD: the update is linear in the gradient, so parameters compare the gradients themselves
    # (Adam's first step is ~lr*sign(g) and would amplify rounding noise in tiny gradients).
    cfg = build_config({**CFG, "seq_len": 32, "lr": 1e-2, "warmup_steps": 0, "optim": "sgd"})
    opt = build_optimizer(model, cfg.technique, cfg.train)
    precision = make_precision("fp32", torch.device("cpu"))
    meter = MemoryMeter(model, opt)
    with meter:
        loss = train_step(model, batches, opt, precision, clip, torch.device("cpu"), meter)
    return loss, meter.stats()


def test_accumulation_equals_large_batch_and_uses_micro_batch_memory():
    torch.manual_seed(0)
    base = GPT(ModelConfig(**CFG))
    x = torch.randint(0, 128, (8, 32))
    y = torch.randint(0, 128, (8, 32))
    for clip in (0.0, 0.05):  # 0.05 makes clipping act, so it must happen once, at the boundary
        big, acc = copy.deepcopy(base), copy.deepcopy(base)
        loss_big, mem_big = _step(big, [(x, y)], clip)
        loss_acc, mem_acc = _step(acc, [(x[:4], y[:4]), (x[4:], y[4:])], clip)
        # Not bitwise: the two halves' means are summed in another order than one mean of 8.
        assert abs(loss_big - loss_acc) < 1e-6
        for (name, p), q in zip(big.named_parameters(), acc.parameters()):
            assert torch.allclose(p, q, atol=1e-6, rtol=1e-5), name
        # Activations of one micro-batch (half the tokens) instead of the whole batch.
        ratio = mem_acc.category_peaks["activations"] / mem_big.category_peaks["activations"]
        assert 0.4 < ratio < 0.6, ratio
