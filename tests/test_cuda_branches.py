"""CUDA-only branches checked on a CPU: the path each one takes, what it hands the library it calls
and what it asks of the device, with stand-ins where the real call needs a GPU (a bitsandbytes
module, a torch.cuda that reports two GPUs)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn as nn

from memtrain.models import qlora


class _RecordingParams4bit:
    """bitsandbytes' ``Params4bit`` as far as ``_quantize_bnb`` uses it: records the tensor it was
    given and the device it was sent to."""

    made: list[dict[str, Any]] = []

    def __init__(self, data: torch.Tensor, **kwargs: Any) -> None:
        self.data, self.kwargs = data, kwargs
        _RecordingParams4bit.made.append({"data": data})

    def to(self, device: torch.device) -> nn.Parameter:
        _RecordingParams4bit.made[-1]["to"] = device
        return nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)  # a Parameter, as Params4bit is


@pytest.fixture
def fake_bitsandbytes(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    bnb = types.ModuleType("bitsandbytes")
    bnb.__spec__ = importlib.machinery.ModuleSpec("bitsandbytes", None)
    bnb.nn = types.SimpleNamespace(Params4bit=_RecordingParams4bit)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bitsandbytes", bnb)
    _RecordingParams4bit.made = []
    return bnb


def test_qlora_on_cuda_quantizes_each_weight_where_it_is(fake_bitsandbytes: types.ModuleType) -> None:
    """The model is built on the GPU; bitsandbytes quantizes a weight on the device ``.to`` names,
    so the weight goes to it as it is, not through the host (a copy of every frozen weight each
    way). Meta weights stand for GPU ones here: a copy to the host cannot be made of them."""
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)).to("meta")
    model.requires_grad_(False)
    originals = [m.weight for m in model]
    assert qlora._quantize_bnb(qlora._frozen_linears(model), torch.device("cuda")) == 0
    made = _RecordingParams4bit.made
    assert [m["to"] for m in made] == [torch.device("cuda")] * 2
    for record, weight in zip(made, originals):
        assert record["data"].device.type == "meta"
        assert record["data"].untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()


def _two_gpus(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """torch.cuda as a machine with two visible GPUs shows it; returns the devices made current."""
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.append(torch.device(d)))
    return current


def test_a_gpu_number_past_the_visible_ones_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    from memtrain.config.run import ConfigError
    from memtrain.runtime.env import resolve_device

    _two_gpus(monkeypatch)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ConfigError, match=r"--device cuda:2: 2 CUDA GPUs are visible \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


def test_one_process_on_gpu_n_makes_it_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels called outside inductor (Liger's, Cut Cross-Entropy's) launch on the current
    device: a run on cuda:1 must make it current, or they run on GPU 0 with GPU 1's pointers."""
    from memtrain.config.run import build_config
    from memtrain.distributed.session import init_distributed

    current = _two_gpus(monkeypatch)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    cfg = build_config({"device": "cuda:1"})
    assert init_distributed(cfg, torch.device("cuda", 1)).device == torch.device("cuda", 1)
    assert current == [torch.device("cuda", 1)]
    init_distributed(cfg, torch.device("cuda"))  # the current device, whichever it is: left alone
    init_distributed(cfg, torch.device("cpu"))
    assert current == [torch.device("cuda", 1)]


def test_the_fp16_optimizer_phase_leaves_the_skipped_count_on_the_device() -> None:
    """Under a GradScaler with a fused AdamW (CUDA's default kernel) torch's own step reads
    nothing; memtrain's count of skipped steps must not either (it read the scale twice a step,
    each read a wait for the device on a GPU). The count is read when asked for, and is right."""
    from memtrain.metrics.host_syncs import HostSyncCounter
    from memtrain.techniques import make_precision
    from memtrain.training.step import _optimizer_phase

    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    precision = make_precision("fp16", torch.device("cpu"))
    assert precision.scaler is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for poisoned in (True, False, False):
        loss = model(torch.randn(4, 8)).square().mean() * (float("inf") if poisoned else 1.0)
        precision.scaler.scale(loss).backward()
        counter = HostSyncCounter()
        with counter:
            _optimizer_phase(model, optimizer, precision, grad_clip=1.0)
        assert counter.total == 0, counter.describe()
    assert precision.skipped_steps == 1
    precision.skipped_steps = 5  # a resumed run's count
    assert precision.skipped_steps == 5


def test_a_cuda_launch_of_more_ranks_than_gpus_is_refused_before_any_starts(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from memtrain.config.run import ConfigError, build_config
    from memtrain.training.preflight import check_before_launch

    _two_gpus(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=80 * 2**30))
    cfg = build_config({"device": "cuda", "distributed": "ddp", "out": str(tmp_path / "out")})
    check_before_launch(cfg, 2)
    with pytest.raises(ConfigError, match="--nproc-per-node 3 starts one rank per GPU, but 2 CUDA GPUs are visible; "
                                          "use --nproc-per-node 2 or fewer"):
        check_before_launch(cfg, 3)
    # CPU ranks share the host: bounded by its memory (test_launch.py), not here by a GPU count; the host
    # given room for them, as this test process's own memory (a lower bound of a rank's) may be large.
    from memtrain.training import size_check

    monkeypatch.setattr(size_check, "host_available_bytes", lambda: 2**50)
    check_before_launch(cfg.replace(device="cpu"), 3)


def test_pin_memory_pins_only_for_a_gpu(tiny_run: dict[str, Any]) -> None:
    """--pin-memory asks for pinned host batches, which only a copy to a GPU uses; on a machine
    without one torch cannot pin (the run failed at its first batch)."""
    from memtrain.config.run import build_config
    from memtrain.training.train import train

    assert train(build_config({**tiny_run, "steps": 2, "pin_memory": True}))["steps"] == 2


def test_a_checkpoint_of_more_gpus_restores_the_rng_of_the_gpus_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint keeps one CUDA RNG state per GPU visible when it was saved; resumed where fewer
    are visible, each GPU here gets its own and the rest are left (an invalid device ordinal before)."""
    from memtrain.checkpoints.exact import restore_rng_and_scaler
    from memtrain.techniques import make_precision

    _two_gpus(monkeypatch)
    restored: list[int] = []

    def set_rng_state(state: torch.Tensor, device: int = 0) -> None:
        if device >= 2:
            raise RuntimeError("CUDA error: invalid device ordinal")
        restored.append(device)

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_rng_state)  # what set_rng_state_all calls
    state = {"rng_cpu": torch.get_rng_state(), "rng_cuda": [torch.zeros(16, dtype=torch.uint8)] * 4,
             "scaler": None, "skipped_steps": 0}
    restore_rng_and_scaler(state, make_precision("fp32", torch.device("cpu")))
    assert restored == [0, 1]
