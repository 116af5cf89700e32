"""The Trainer's dataset: memtrain's training blocks, in memtrain's batch order."""

from __future__ import annotations

from typing import Any

import torch

from memtrain.config.run import ConfigError, RunConfig


class OrderedBlocks(torch.utils.data.Dataset):
    """memtrain's training blocks as Trainer examples, in memtrain's batch order.

    Item ``i`` is block ``order[i]`` as ``{"input_ids": x, "labels": y, "shift_labels": y}``; read
    sequentially in batches of ``batch_size`` it reproduces memtrain's batches exactly.
    """

    def __init__(self, blocks: Any, order: list[int]) -> None:
        self.blocks = blocks  # memtrain.data.BlockDataset
        self.order = order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, y = self.blocks[self.order[i]]
        return {"input_ids": x, "labels": y, "shift_labels": y}


def training_order(n_blocks: int, batch_size: int, seed: int, n_batches: int) -> list[int]:
    """Block indices of memtrain's first ``n_batches`` training batches, flattened."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.data import ResumableBatchSampler

    order: list[int] = []
    it = iter(ResumableBatchSampler(n_blocks, batch_size, seed))
    for _ in range(n_batches):
        order.extend(next(it))
    return order


def hf_train_dataset(tokens: Any, cfg: RunConfig) -> OrderedBlocks:
    """The Trainer's dataset: exactly the micro-batches memtrain's loader gives for ``cfg``."""
    # on this side's turn: the package imports no torch before the lockstep baton
    from memtrain.data import BlockDataset

    t = cfg.train
    blocks = BlockDataset(tokens, t.seq_len)
    if len(blocks) < t.batch_size:
        raise ConfigError(f"training corpus has fewer than {t.batch_size} blocks of {t.seq_len + 1} tokens; "
                          "use more data or lower --batch-size / --seq-len")
    return OrderedBlocks(blocks, training_order(len(blocks), t.batch_size, t.seed, t.steps * t.grad_accum))

