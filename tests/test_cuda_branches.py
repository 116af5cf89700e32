"""CUDA-only branches checked on a CPU: the path each one takes and what it hands the libraries
it calls (bitsandbytes, the device allocator), with stand-ins where the real call needs a GPU."""

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
