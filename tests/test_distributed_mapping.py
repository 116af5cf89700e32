"""What each --distributed strategy asks torch for (the wrap, FSDP2's resharding, its mixed
precision and offload policies), read from the calls without a process group."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from memtrain.config.run import ModelConfig, TechniqueConfig
from memtrain.distributed import wrapping
from memtrain.models.gpt import GPT
from memtrain.techniques.precision import make_precision

CPU = torch.device("cpu")
TINY = ModelConfig(vocab_size=64, d_model=16, n_heads=2, n_layers=3, d_ff=32, max_seq_len=16, dropout=0.0)


@pytest.fixture
def calls(monkeypatch):
    """fully_shard's and DDP's calls, recorded in place of a process group of 2."""
    seen: list = []
    monkeypatch.setattr(wrapping.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(wrapping.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(wrapping, "init_device_mesh", lambda kind, shape: ("mesh", kind, shape))
    monkeypatch.setattr(wrapping, "fully_shard", lambda module, **kw: seen.append((module, kw)))
    monkeypatch.setattr(wrapping.nn.parallel, "DistributedDataParallel",
                        lambda module, **kw: seen.append((module, kw)) or module)
    return seen


@pytest.mark.parametrize(("strategy", "reshard"), [("zero2", False), ("fsdp", True)])
def test_fsdp_strategies_shard_each_block_then_the_root(calls, strategy, reshard):
    """zero2 keeps the gathered weights from forward to backward (ZeRO-2: only gradients and
    optimizer state sharded between steps' uses); fsdp frees them after the forward (ZeRO-3)."""
    model = GPT(TINY)
    wrapping.apply_distributed(model, TechniqueConfig(distributed=strategy), CPU, make_precision("fp32", CPU))
    assert [m for m, _ in calls] == [*model.blocks, model]  # bottom-up, as fully_shard requires
    for _, kw in calls:
        assert kw["reshard_after_forward"] is reshard and kw["mesh"] == ("mesh", "cpu", (2,))
        assert kw["mp_policy"].param_dtype is None and type(kw["offload_policy"]) is OffloadPolicy


def test_bf16_gathers_bf16_weights_and_reduces_in_fp32_and_offload_pins_host_memory(calls):
    model = GPT(TINY)
    tech = TechniqueConfig(distributed="fsdp", precision="bf16", cpu_offload=True)
    wrapping.apply_distributed(model, tech, CPU, make_precision("bf16", CPU))
    kw = calls[-1][1]
    assert kw["mp_policy"].param_dtype == torch.bfloat16 and kw["mp_policy"].reduce_dtype == torch.float32
    assert isinstance(kw["offload_policy"], CPUOffloadPolicy) and kw["offload_policy"].pin_memory


@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_ddp_strategies_wrap_the_whole_model_with_gradients_in_its_buckets(calls, strategy):
    model = GPT(TINY)
    wrapping.apply_distributed(model, TechniqueConfig(distributed=strategy), CPU, make_precision("fp32", CPU))
    assert len(calls) == 1 and calls[0][0] is model
    assert calls[0][1] == {"device_ids": None, "gradient_as_bucket_view": True}


def test_zero1_keeps_the_optimizer_class_and_its_settings():
    """ZeRO-1 rebuilds the same optimizer per shard with the same hyper-parameters."""
    params = [nn.Parameter(torch.zeros(4, 2))]
    opt = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    kwargs = wrapping._constructor_kwargs(opt)
    assert kwargs["lr"] == 3e-4 and kwargs["betas"] == (0.9, 0.95) and kwargs["weight_decay"] == 0.1
