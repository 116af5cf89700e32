"""Token blocks, the resumable training loader and the fixed validation batches.

The token stream is cut into non-overlapping blocks of ``seq_len + 1`` tokens; block ``i``
gives the input ``x`` (its first ``seq_len`` tokens) and the target ``y`` (the same tokens
shifted by one; with a target mask, ``--loss-on completion``, -100 where a token is a
prompt's). Training visits the blocks in a seeded permutation per epoch, so the batch order is
a pure function of (seed, epoch, batch index): that is what makes an exact resume possible with
nothing more than two integers in the checkpoint.

Usage::

    loader = make_train_loader(splits.train, seq_len=256, batch_size=8, seed=1337)
    x, y = loader.next_batch()          # or: for x, y in loader: ... (infinite)
    state = loader.state_dict()         # {"epoch": 0, "batch_index": 1}
    loader.load_state_dict(state)       # continues with exactly the next batch
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Optional, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from memtrain.config.run import ConfigError, DataConfig
from memtrain.data.cache import TokenSplits
from memtrain.data.sources import TEXT_SUFFIXES, TXT_DOC_CHARS

Batch = tuple[torch.Tensor, torch.Tensor]
# The target of a token that is no target (--loss-on completion: a prompt's): every loss ignores it,
# as torch's cross_entropy and transformers' labels do.
IGNORE_INDEX = -100


class MicroBatches(list):
    """One step's micro-batches (a list of :data:`Batch`), with ``target_counts``: each one's
    count of targets (not IGNORE_INDEX), counted on the host from the loader's CPU tensors, so
    the step can average over the answer tokens of the whole accumulated batch as transformers'
    Trainer does (``num_items_in_batch``) without reading anything back from the device.
    None where every micro-batch holds the same count (text data: every token a target)."""

    target_counts: Optional[list[int]] = None

    def loss_scales(self, device: torch.device) -> Optional[list[Union[float, torch.Tensor]]]:
        """What each micro-batch's mean loss is multiplied by so that the step's gradient is that
        of the mean over every target of the accumulated (global) batch: count_i / total, times
        the ranks over the global total where data parallelism averages gradients over ranks (as
        the Trainer's ``average_tokens_across_devices``, on by default). None without counts:
        the caller divides by the micro-batch count, as it always did (text data, bit for bit)."""
        if self.target_counts is None:
            return None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            total = sum(self.target_counts)
            # A step without any answer token: each micro-batch's loss is already 0 (answer_targets).
            return [count / total if total else 0.0 for count in self.target_counts]
        # The global count, summed on the device: the all-reduce is queued, never read by the host.
        total_t = torch.tensor(float(sum(self.target_counts)), dtype=torch.float64, device=device)
        dist.all_reduce(total_t)
        per_token = (world / total_t.clamp_min(1.0))
        return [(per_token * count).float() for count in self.target_counts]


def host_target_count(y: torch.Tensor) -> int:
    """How many of host tensor ``y``'s targets a loss averages (those not IGNORE_INDEX)."""
    return int(y.ne(IGNORE_INDEX).sum())


class BlockDataset(Dataset):
    """Non-overlapping blocks of ``seq_len + 1`` tokens; item ``i`` is ``(x, y)``, int64, length ``seq_len``.

    The tail shorter than one block is dropped. ``tokens`` is usually a read-only np.memmap:
    a block is copied out of it only when requested. ``mask`` (--loss-on completion; as long as
    ``tokens``, 1 where the token is a target): a target whose token is not one is IGNORE_INDEX in ``y``.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, mask: Optional[np.ndarray] = None) -> None:
        if seq_len <= 0:
            raise ConfigError(f"--seq-len must be positive, got {seq_len}")
        self.tokens = tokens
        self.mask = mask
        self.seq_len = seq_len
        self.block_len = seq_len + 1
        self.n_blocks = len(tokens) // self.block_len

    @property
    def ignores_targets(self) -> bool:
        """Whether a batch's targets may hold IGNORE_INDEX (then counted per micro-batch)."""
        return self.mask is not None

    def __len__(self) -> int:
        return self.n_blocks

    def __getitem__(self, index: int) -> Batch:
        if index < 0:
            index += self.n_blocks
        if not 0 <= index < self.n_blocks:
            raise IndexError(f"block {index} out of range for {self.n_blocks} blocks")
        start = index * self.block_len
        block = torch.from_numpy(np.asarray(self.tokens[start : start + self.block_len], dtype=np.int64))
        if self.mask is not None:
            return block[:-1], self._masked(block[1:], self.mask[start + 1 : start + self.block_len])
        return block[:-1], block[1:]

    def batch(self, indices: list[int]) -> Batch:
        """Blocks ``indices`` as one ``(x, y)`` batch, each (len(indices), seq_len) int64: what
        the DataLoader's default collate makes of ``[self[i] for i in indices]``, in one
        vectorized gather instead of a Python loop over the blocks: about 5x less host time
        (docs/performance.md, "The loader keeps up"). On an H100 the compiled seed step (9 ms)
        waited 8.7% of its time for data, more than the loop itself takes; the loop also needs
        the interpreter, which such a step's kernel launches keep busy."""
        starts = np.asarray(indices, dtype=np.int64) * self.block_len
        if starts.size and (starts.min() < 0 or starts.max() >= self.n_blocks * self.block_len):
            raise IndexError(f"blocks {list(indices)} out of range for {self.n_blocks} blocks")
        rows = np.asarray(self.tokens[starts[:, None] + np.arange(self.block_len)], dtype=np.int64)
        block = torch.from_numpy(rows)
        if self.mask is not None:
            y = self._masked(block[:, 1:].contiguous(), self.mask[starts[:, None] + np.arange(1, self.block_len)])
            return block[:, :-1].contiguous(), y
        return block[:, :-1].contiguous(), block[:, 1:].contiguous()

    @staticmethod
    def _masked(y: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
        """``y`` (a copy, never the tokens' map) with IGNORE_INDEX where ``mask`` is 0."""
        return y.masked_fill(torch.from_numpy(np.asarray(mask) == 0), IGNORE_INDEX)

    def target_blocks(self, count: int) -> torch.Tensor:
        """The targets of the first ``count`` blocks, (count, seq_len) int64: the blocks' tokens
        after their first, IGNORE_INDEX where the mask says a token is no target."""
        y = self.blocks(count)[:, 1:].contiguous()
        if self.mask is None:
            return y
        mask = np.asarray(self.mask[: count * self.block_len]).reshape(count, self.block_len)[:, 1:]
        return self._masked(y, mask)

    def blocks(self, count: int) -> torch.Tensor:
        """The first ``count`` blocks as one (count, seq_len + 1) int64 tensor."""
        flat = np.asarray(self.tokens[: count * self.block_len], dtype=np.int64)
        return torch.from_numpy(flat.reshape(count, self.block_len))

    # A memmap would be pickled as a full copy of its data when worker processes are
    # spawned (rather than forked); a whole-file map travels as its file name instead.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("tokens", "mask"):
            arr = state.get(key)
            if isinstance(arr, np.memmap) and _is_whole_file_map(arr):
                state[key] = ("memmap", str(arr.filename), arr.dtype.str, int(arr.offset), len(arr))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key in ("tokens", "mask"):
            arr = state.get(key)
            if isinstance(arr, tuple) and arr[0] == "memmap":
                _, filename, dtype, offset, length = arr
                state[key] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", offset=offset, shape=(length,))
        state.setdefault("mask", None)
        self.__dict__.update(state)


class RecordRows(BlockDataset):
    """--packing pad: one row per record (TRL SFTTrainer's default, ``packing=False``). Row ``i``
    holds record ``i``'s ids (its eos included) cut at ``seq_len + 1`` tokens, right-padded; ``x``
    is its first ``seq_len`` tokens, ``y`` the same shifted by one, IGNORE_INDEX past the record's
    end (and, with ``mask``, where a token is no target).

    Right padding under a causal model needs no attention mask and no position ids: a real token
    attends only to the tokens before it, all real, and sits at the same position as in an
    unpadded row; the pads' own outputs are never targets. ``offsets`` (the cache's, n_records + 1
    values: each record's start, then the split's length) are the boundaries the tokenizing drew.
    A record of one token (an eos alone: nothing to predict) gets no row."""

    def __init__(self, tokens: np.ndarray, seq_len: int, offsets: np.ndarray,
                 mask: Optional[np.ndarray] = None) -> None:
        super().__init__(tokens, seq_len, mask)
        starts, ends = np.asarray(offsets[:-1], dtype=np.int64), np.asarray(offsets[1:], dtype=np.int64)
        kept = ends - starts >= 2
        self.starts = starts[kept]
        self.lengths = np.minimum(ends[kept] - self.starts, self.block_len)  # tokens of each row
        self.n_blocks = len(self.starts)
        self._cut = ends[kept] - self.starts > self.block_len  # each row's record: longer than the row
        self.n_truncated = int(self._cut.sum())
        self.n_skipped = int((~kept).sum())

    def truncated_rows(self, count: Optional[int] = None) -> int:
        """How many of the first ``count`` rows (all: None) hold a record cut at ``seq_len + 1``:
        of a validation split's, those its loss is read on (the first --val-blocks)."""
        return int(self._cut[:count].sum())

    @property
    def ignores_targets(self) -> bool:
        return True

    def pad_fraction(self, count: Optional[int] = None) -> float:
        """The share of the first ``count`` rows' ``seq_len`` input positions that are padding."""
        lengths = self.lengths[:count]
        return 0.0 if not len(lengths) else 1.0 - float((lengths - 1).sum()) / (len(lengths) * self.seq_len)

    def __getitem__(self, index: int) -> Batch:
        if index < 0:
            index += self.n_blocks
        if not 0 <= index < self.n_blocks:
            raise IndexError(f"row {index} out of range for {self.n_blocks} rows")
        x, y = self.batch([index])
        return x[0], y[0]

    def batch(self, indices: list[int]) -> Batch:
        """Rows ``indices`` as one ``(x, y)`` batch, each (len(indices), seq_len) int64, gathered
        in one vectorized read as :meth:`BlockDataset.batch` does."""
        rows = np.asarray(indices, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.n_blocks):
            raise IndexError(f"rows {list(indices)} out of range for {self.n_blocks} rows")
        return self._rows(self.starts[rows], self.lengths[rows])

    def _rows(self, starts: np.ndarray, lengths: np.ndarray) -> Batch:
        """Rows of ``lengths`` tokens from ``starts``, padded to ``block_len``: ``x`` pads with id 0
        (any id: no real token attends to it), ``y`` with IGNORE_INDEX."""
        cols = np.arange(self.block_len)
        real = cols[None, :] < lengths[:, None]
        where = np.where(real, starts[:, None] + cols, 0)  # a pad reads id 0's place, then is overwritten
        block = torch.from_numpy(np.where(real, np.asarray(self.tokens[where], dtype=np.int64), 0))
        targets = real[:, 1:]
        if self.mask is not None:
            targets = targets & (np.asarray(self.mask[where[:, 1:]]) == 1)
        y = block[:, 1:].masked_fill(torch.from_numpy(~targets), IGNORE_INDEX)
        return block[:, :-1].contiguous(), y.contiguous()

    def target_blocks(self, count: int) -> torch.Tensor:
        return self._rows(self.starts[:count], self.lengths[:count])[1]

    def blocks(self, count: int) -> torch.Tensor:
        """The first ``count`` rows' inputs and last target token, (count, seq_len + 1) int64 (pads 0)."""
        x, y = self._rows(self.starts[:count], self.lengths[:count])
        return torch.cat([x, y[:, -1:].clamp_min(0)], dim=1)


def _is_whole_file_map(arr: np.memmap) -> bool:
    """True for a map made directly on a file, from ``offset`` to its end (not a slice of one)."""
    if arr.filename is None or arr.ndim != 1 or isinstance(arr.base, np.ndarray):  # a slice's base is its parent
        return False
    try:
        return int(arr.offset) + arr.nbytes == os.path.getsize(arr.filename)
    except OSError:
        return False


class ResumableBatchSampler(Sampler[list[int]]):
    """Infinite batches of block indices, reproducible from (seed, epoch, batch index).

    Epoch ``e`` visits the blocks in the permutation drawn with seed ``seed + e``; it is cut
    into global batches of ``batch_size * world_size`` (an incomplete last one is dropped)
    and rank ``r`` takes slice ``r`` of each, so ranks never share a block. Iteration starts
    at (``epoch``, ``batch_index``).
    """

    def __init__(
        self,
        n_blocks: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        epoch: int = 0,
        batch_index: int = 0,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in [0, world_size={world_size})")
        self.n_blocks = n_blocks
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.epoch = epoch
        self.batch_index = batch_index

    @property
    def batches_per_epoch(self) -> int:
        return self.n_blocks // (self.batch_size * self.world_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The block permutation of one epoch (identical on every rank)."""
        return np.random.default_rng(self.seed + epoch).permutation(self.n_blocks)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.batch_index
        global_batch = self.batch_size * self.world_size
        while True:
            order = self.epoch_order(epoch)
            for b in range(start, self.batches_per_epoch):
                first = b * global_batch + self.rank * self.batch_size
                yield order[first : first + self.batch_size].tolist()
            epoch, start = epoch + 1, 0


class TrainLoader:
    """Infinite training batches with an exact, cheap resume.

    ``next_batch()`` returns the next ``(x, y)``; iterating the loader does the same forever.
    :meth:`state_dict` counts the batches already returned to the caller, not those that
    DataLoader workers have prefetched, so restoring it with :meth:`load_state_dict` (here
    or in a new loader over the same tokens) continues with exactly the batch an
    uninterrupted loader would return next.
    """

    def __init__(
        self,
        dataset: BlockDataset,
        batch_size: int,
        seed: int,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.batch_index = 0
        self._iterator: Iterator[Any] | None = None
        self.batches_per_epoch = self._sampler().batches_per_epoch

    def _sampler(self) -> ResumableBatchSampler:
        return ResumableBatchSampler(
            len(self.dataset), self.batch_size, self.seed, self.rank, self.world_size,
            epoch=self.epoch, batch_index=self.batch_index,
        )

    def _start(self) -> Iterator[Any]:
        """A batch iterator beginning at the current position: without workers, the blocks are
        gathered here (:meth:`BlockDataset.batch`, the same batches as the DataLoader's, without
        its per-sample loop); with workers, a DataLoader."""
        if self.num_workers == 0:
            return self._gathered()
        extra = {"prefetch_factor": self.prefetch_factor} if self.num_workers > 0 and self.prefetch_factor else {}
        loader = DataLoader(
            self.dataset,
            batch_sampler=self._sampler(),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            # A private generator: creating a DataLoader iterator draws a worker base seed, and
            # from the global RNG that draw would shift dropout masks after a resume.
            generator=torch.Generator().manual_seed(self.seed + 7919 * self.epoch + self.batch_index),
            **extra,  # type: ignore[arg-type]  # extra holds only DataLoader keyword arguments
        )
        return iter(loader)

    def _gathered(self) -> Iterator[Batch]:
        for indices in self._sampler():
            x, y = self.dataset.batch(indices)
            yield (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)

    def next_batch(self) -> Batch:
        """The next ``(x, y)`` batch, each of shape (batch_size, seq_len), int64."""
        if self._iterator is None:
            self._iterator = self._start()
        x, y = next(self._iterator)
        self.batch_index += 1
        if self.batch_index == self.batches_per_epoch:
            self.epoch, self.batch_index = self.epoch + 1, 0
        return x, y

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Position after the batches returned so far: ``{"epoch", "batch_index"}``."""
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a position saved by :meth:`state_dict`; prefetched batches are discarded."""
        epoch, index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= index < self.batches_per_epoch:
            raise ConfigError(
                f"loader state {state} does not fit this data ({self.batches_per_epoch} batches per epoch); "
                f"resume with the same data, --batch-size and --seq-len"
            )
        self.close()
        self.epoch, self.batch_index = epoch, index

    def close(self) -> None:
        """Stop worker processes (they are restarted on the next batch)."""
        self._iterator = None


def make_train_loader(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    mask: Optional[np.ndarray] = None,
    offsets: Optional[np.ndarray] = None,
) -> TrainLoader:
    """A :class:`TrainLoader` over ``tokens`` (and their target ``mask``, --loss-on completion);
    with record ``offsets`` (--packing pad), one padded row per record. ConfigError if they do
    not fill one global batch."""
    if batch_size <= 0:
        raise ConfigError(f"--batch-size must be positive, got {batch_size}")
    needed = batch_size * world_size
    dataset = BlockDataset(tokens, seq_len, mask) if offsets is None else RecordRows(tokens, seq_len, offsets, mask)
    if len(dataset) < needed:
        shape = f"{batch_size} x {world_size} ranks" if world_size > 1 else f"{batch_size}"
        if offsets is not None:
            raise ConfigError(f"--packing pad: the training split has {len(dataset):,} records of two tokens or more "
                              f"(one row each), fewer than one batch needs ({shape} = {needed:,}); use more data or "
                              "lower --batch-size")
        raise ConfigError(
            f"training corpus has {len(tokens):,} tokens, fewer than one batch needs "
            f"({shape} x {seq_len + 1} = {needed * (seq_len + 1):,}); "
            f"use more data or lower --batch-size / --seq-len"
        )
    return TrainLoader(dataset, batch_size, seed, num_workers, pin_memory, prefetch_factor, rank, world_size)


def check_split_documents(splits: TokenSplits, data: DataConfig) -> None:
    """ConfigError, naming what the data holds and what to change, when the document-level
    split left a split without any document: the token-count lines of the loaders could only
    say "raise --val-fraction", which cannot help data of one document (it lands wholly in
    one split) and does not say why the split is empty."""
    train, val = splits.n_train_docs, splits.n_val_docs
    if train and val:
        return
    total, empty = train + val, "training" if not train else "validation"
    txt = data.data.lower().endswith(TEXT_SUFFIXES)
    # How a .txt becomes documents (memtrain.data.sources._txt_documents), the usual surprise.
    how = (f" (a .txt is cut into documents at the first blank line after each {TXT_DOC_CHARS:,} characters, "
           f"at any line break after {4 * TXT_DOC_CHARS:,})") if txt else ""
    if total <= 1:
        more = ("put a blank line between its documents, give more text, or give a .jsonl with one document per line"
                if txt else "give data of more than one document")
        raise ConfigError(f"the {empty} split is empty: --data {data.data} is one document{how}, and a document lands "
                          f"wholly in one split; {more}")
    if not val:
        suggest = min(0.5, float(f"{2 / total:.2g}"))  # about two documents expected in validation
        raise ConfigError(f"the validation split is empty: none of the {total:,} documents of --data {data.data}{how} was "
                          f"drawn for it at --val-fraction {data.val_fraction}; raise --val-fraction (to {suggest} or "
                          "more), change --split-seed or use more data")
    raise ConfigError(f"the training split is empty: all {total:,} documents of --data {data.data}{how} were drawn for "
                      f"validation at --val-fraction {data.val_fraction}; lower --val-fraction, change --split-seed or "
                      "use more data")


def make_val_batches(tokens: np.ndarray, seq_len: int, n_blocks: int, batch_size: int,
                     mask: Optional[np.ndarray] = None, offsets: Optional[np.ndarray] = None) -> list[Batch]:
    """The first ``min(n_blocks, available)`` validation blocks, in order, as (x, y) batches
    (``mask``: --loss-on completion's targets, IGNORE_INDEX elsewhere in ``y``; ``offsets``:
    --packing pad, a block is a record's padded row).

    A fixed subset, so every evaluation (and every technique in a benchmark) measures loss
    on the same tokens. The last batch may be smaller than ``batch_size``.
    """
    if n_blocks <= 0 or batch_size <= 0:
        raise ConfigError(f"--val-blocks and --batch-size must be positive, got {n_blocks} and {batch_size}")
    dataset = BlockDataset(tokens, seq_len, mask) if offsets is None else RecordRows(tokens, seq_len, offsets, mask)
    if len(dataset) == 0:
        if offsets is not None:
            raise ConfigError("--packing pad: the validation split holds no record of two tokens or more (one row "
                              "each); raise --val-fraction or use more data")
        raise ConfigError(
            f"validation split has {len(tokens):,} tokens, fewer than one block needs ({seq_len + 1:,}); "
            f"raise --val-fraction, use more data or lower --seq-len"
        )
    count = min(n_blocks, len(dataset))
    blocks = dataset.blocks(count)
    if dataset.ignores_targets:
        return list(zip((chunk[:, :-1].contiguous() for chunk in torch.split(blocks, batch_size)),
                        torch.split(dataset.target_blocks(count), batch_size)))
    return [
        (chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())
        for chunk in torch.split(blocks, batch_size)
    ]
