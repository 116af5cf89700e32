"""Host syncs in a training step (memtrain.metrics.host_syncs): on a GPU every read of a device
value by the host drains the kernel queue, so a sync inside a layer, a hook, the loss or a
checkpointed recompute makes each step slower than it need be. These tests pin the count, on the
CPU, for memtrain's GPT under every technique that changes the forward or backward, and for a
transformers model beside the Trainer-equivalent step."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import TINY_MODEL
from memtrain.config.run import build_config
from memtrain.metrics.host_syncs import HostSyncCounter
from memtrain.techniques.checkpointing import checkpointed_call
from memtrain.training.step import build_state, random_micro_batches

CPU = torch.device("cpu")
RUN = {**TINY_MODEL, "dropout": 0.1, "vocab_size": 512, "batch_size": 2, "seq_len": 16, "device": "cpu",
       "progress": False}


class _CountedPhases:
    """train_step's ``meter`` seam: the counter around forward and backward. The optimizer phase is
    left out: a compiled update (bf16-pure's) cannot run under a dispatch mode, and torch's
    optimizers read only their CPU step counts."""

    def __init__(self, counter: HostSyncCounter) -> None:
        self.counter = counter

    def phase(self, name: str):
        return self.counter if name != "optimizer" else contextlib.nullcontext()


def _count_second_step(cfg) -> HostSyncCounter:
    """Host syncs in the forward and backward passes of ``cfg``'s second step (the first one
    creates the optimizer state and may take one-off paths)."""
    state = build_state(cfg, CPU)
    g = torch.Generator().manual_seed(0)
    counter = HostSyncCounter()
    for i in range(2):
        micro = random_micro_batches(cfg, cfg.train.batch_size, CPU, g)
        state.step_fn(state.model, micro, state.optimizer, state.precision, cfg.train.grad_clip, state.device,
                      _CountedPhases(counter) if i == 1 else None)
    return counter


# ----------------------------------------------------------------------------- the counter
def test_counter_counts_every_kind_of_host_read_and_nothing_else():
    x = torch.randn(8)
    counter = HostSyncCounter()
    with counter:
        x.sum().item()
        bool(x[0] > 0)
        x[x > 0]  # a boolean mask as an index: nonzero inside
        torch.nonzero(x)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.equal(x, x)
        x[x > 5] = 0
    assert counter.total == 7
    assert {op for op, _ in counter.sites} == {"_local_scalar_dense", "index", "nonzero", "repeat_interleave",
                                              "equal", "index_put_"}
    assert all("test_host_syncs.py" in site for _, site in counter.sites)  # the caller, not torch

    quiet = HostSyncCounter()
    with quiet:
        y = x * 2 + torch.ones(8)
        y[torch.tensor([0, 3])] = 1.0  # integer indices: no sync
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        torch.softmax(y, 0).sum()
    assert quiet.total == 0 and quiet.describe() == "none"


def test_counter_sees_blocking_device_to_host_copies_only():
    counter = HostSyncCounter()
    with FakeTensorMode():  # a CUDA tensor without a GPU
        x = torch.empty(4, device="cuda")
        with counter:
            x.cpu()
            torch.empty(4).copy_(x)
            x.to("cpu", non_blocking=True)  # into pinned memory: the host does not wait
            x.to(torch.float16)  # a cast on the device
            x * 2
    assert sorted(op for op, _ in counter.sites) == ["_to_copy", "copy_"]


def test_a_read_inside_a_checkpointed_block_is_counted_in_forward_and_again_in_its_recompute():
    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            scale = 2.0 if x.sum().item() > 0 else 1.0  # the kind of read this file guards against
            return torch.tanh(self.lin(x)) * scale  # tanh keeps its output: backward recomputes the block

    block, x = Reads(), torch.randn(2, 4, requires_grad=True)
    counter = HostSyncCounter()
    with counter:
        out = checkpointed_call(block.forward, None, x)
    assert counter.total == 1
    with counter:
        out.sum().backward()
    assert counter.total == 2 and "Reads" not in counter.describe() and "forward" in counter.describe()


# ----------------------------------------------------------------------------- memtrain's GPT
@pytest.mark.parametrize("techniques", [
    {},
    {"attention": "sdpa"},
    {"attention": "flash", "dropout": 0.0},
    {"attention": "sdpa", "window": 4},
    {"attention": "math", "window": 4},
    {"checkpointing": "full"},
    {"checkpointing": "selective"},
    {"checkpointing": "selective-matmul"},
    {"checkpointing": "every:2"},
    {"loss": "chunked", "loss_chunk": 8},
    {"lora_rank": 4},
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"precision": "bf16-pure"},
    {"grad_accum": 2},
    {"offload_activations": True},
], ids=lambda t: "+".join(f"{k}={v}" for k, v in t.items()) or "baseline")
def test_gpt_forward_and_backward_never_make_the_host_wait(techniques):
    counter = _count_second_step(build_config({**RUN, **techniques}))
    assert counter.total == 0, counter.describe()


# ----------------------------------------------------------------------------- transformers
def test_transformers_step_syncs_once_per_forward_in_transformers_own_mask_as_the_trainers_does():
    pytest.importorskip("transformers")
    from memtrain.bench.hf.probe import HFStep, _random_micro_batches

    cfg = build_config({"model": "tiny-llama", "lora_rank": 4, "precision": "bf16-pure", "checkpointing": "full",
                        "attention": "sdpa", "batch_size": 1, "seq_len": 32, "grad_accum": 2, "device": "cpu",
                        "progress": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _count_second_step(cfg)
        # transformers' causal-mask builder checks the position ids for packed sequences (one
        # read of a device value per forward, before the first layer); none in the layers, the
        # checkpointed recomputes or memtrain's loss
        assert ours.total == 2, ours.describe()
        assert all(site.startswith("transformers/masking_utils.py") for _, site in ours.sites), ours.describe()

        theirs = HostSyncCounter()
        hf = HFStep(cfg, CPU)
        micro = _random_micro_batches(cfg, 1, CPU)
        hf.step(micro, lambda name: contextlib.nullcontext())
        hf.step(micro, lambda name: theirs if name != "optimizer" else contextlib.nullcontext())
    assert ours.total <= theirs.total, (ours.describe(), theirs.describe())
