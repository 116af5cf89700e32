"""What would slow a GPU step without changing a number: host syncs (memtrain.metrics.host_syncs)
and measurement machinery left on during the timed steps.

On a GPU every read of a device value by the host drains the kernel queue, so a sync inside a
layer, a hook, the loss or a checkpointed recompute makes each step slower than it need be. These
tests pin the count, on the CPU, for memtrain's GPT under every technique that changes the forward
or backward, and for a transformers model beside the Trainer-equivalent step; and they check that
the memory meters, which see every op, are gone when the loop's timed steps run."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from conftest import TINY_MODEL
from memtrain.config.run import build_config
from memtrain.metrics.host_syncs import HostSyncCounter
from memtrain.techniques.checkpointing import checkpointed_call
from memtrain.training import train as train_module
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
def test_transformers_step_syncs_at_most_once_per_forward_and_only_where_the_trainers_does():
    pytest.importorskip("transformers")
    from memtrain.bench.hf.probe import HFStep, _random_micro_batches

    cfg = build_config({"model": "tiny-llama", "lora_rank": 4, "precision": "bf16-pure", "checkpointing": "full",
                        "attention": "sdpa", "batch_size": 1, "seq_len": 32, "grad_accum": 2, "device": "cpu",
                        "progress": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = _count_second_step(cfg)
        # At most one read of a device value per forward (2 micro-batches), none per layer or
        # checkpointed recompute, none in memtrain's loss. (transformers 5.24's causal-mask builder
        # makes that one: it checks the position ids for packed sequences, in masking_utils.py.)
        assert ours.total <= 2, ours.describe()

        theirs = HostSyncCounter()
        hf = HFStep(cfg, CPU)
        micro = _random_micro_batches(cfg, 1, CPU)
        hf.step(micro, lambda name: contextlib.nullcontext())
        hf.step(micro, lambda name: theirs if name != "optimizer" else contextlib.nullcontext())
    # every sync of ours is one the Trainer's step makes too, at the same place
    assert all(n <= theirs.sites[key] for key, n in ours.sites.items()), (ours.describe(), theirs.describe())


# ----------------------------------------------------------------------------- the loop's timed steps
def _module_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(m._backward_pre_hooks) for m in model.modules())


def _global_hooks() -> int:
    mm = torch.nn.modules.module
    return sum(len(d) for d in (mm._global_forward_hooks, mm._global_forward_pre_hooks,
                                mm._global_backward_hooks, mm._global_backward_pre_hooks))


@pytest.mark.parametrize("extra", [{"memory_by_module": True, "checkpointing": "full"},
                                   {"memory_by_module": True, "lora_rank": 4, "loss": "chunked"}],
                         ids=["by-module+checkpointing", "by-module+lora+chunked"])
def test_the_timed_steps_run_without_the_meters(tiny_run, monkeypatch, extra):
    """The metered steps (the first ones, inside the timing warm-up) run under dispatch modes and
    module hooks; every later step must run with none of them, and with the model's own hooks
    only, or the reported step time is the meter's."""
    seen: list[dict] = []
    baseline: dict = {}
    real_build, real_step = train_module.build_state, train_module.run_step

    def build_state_spy(*args, **kwargs):
        state = real_build(*args, **kwargs)
        baseline["module_hooks"] = _module_hooks(state.model)
        return state

    def run_step_spy(state, micro, meter=None, **contexts):
        seen.append({"dispatch_modes": len(_get_current_dispatch_mode_stack()),
                     "function_modes": len(_get_current_function_mode_stack()),
                     "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
                     "global_hooks": _global_hooks(), "module_hooks": _module_hooks(state.model),
                     "metered": meter is not None})
        return real_step(state, micro, meter, **contexts)

    monkeypatch.setattr(train_module, "build_state", build_state_spy)
    monkeypatch.setattr(train_module, "run_step", run_step_spy)
    result = train_module.train(build_config({**tiny_run, "steps": 6, "warmup_steps": 1, **extra}))
    metered = len(train_module.METERED_STEPS)
    assert result["memory"]["by_module"]  # the meters did run, in the first steps
    assert [s["metered"] for s in seen] == [True] * metered + [False] * (6 - metered)
    assert seen[0]["dispatch_modes"] >= 1 and seen[0]["global_hooks"] > 0  # the meter and the module tracker
    bare = {"dispatch_modes": 0, "function_modes": 0, "saved_tensor_hooks": False, "global_hooks": 0,
            "module_hooks": baseline["module_hooks"], "metered": False}
    assert seen[metered:] == [bare] * (6 - metered)
