"""Models are built where they train, in the weight dtype they train in (no FP32 host copy first)."""

from __future__ import annotations

import pytest
import torch

import memtrain.training.step as step_module
from conftest import TINY_MODEL
from memtrain.config.run import build_config
from memtrain.techniques import make_precision
from memtrain.training.step import build_base_model, build_state, building_on

CPU = torch.device("cpu")


def _gpt_cfg(**kw):
    return build_config({**TINY_MODEL, "seq_len": 32, "device": "cpu", **kw})


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.float32),
                                              ("bf16-pure", torch.bfloat16)])
def test_the_gpt_is_created_in_the_weight_dtype(monkeypatch, precision, dtype):
    """The parameters are born in the weight dtype (seen by the family's build itself, before
    any technique or ``.to`` could cast them), and the default dtype is restored afterwards."""
    seen = {}
    real_build = step_module.build_model

    def spy(cfg, *args, **kwargs):
        model = real_build(cfg, *args, **kwargs)
        seen["dtypes"] = {p.dtype for p in model.parameters()}
        return model

    monkeypatch.setattr(step_module, "build_model", spy)
    cfg = _gpt_cfg(precision=precision)
    state = build_state(cfg, CPU, make_precision(precision, CPU))
    assert seen["dtypes"] == {dtype}
    assert {p.dtype for p in state.model.parameters()} == {dtype}
    assert torch.get_default_dtype() == torch.float32


def test_the_device_context_reaches_every_parameter():
    """Built under the target device: the meta device stands in for a GPU here (nothing is
    allocated), so a model built for it holds no host tensor at all."""
    model = build_base_model(_gpt_cfg(precision="bf16-pure"), torch.device("meta"),
                             make_precision("bf16-pure", CPU))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} <= {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_building_on_restores_the_default_dtype_after_a_failure():
    with pytest.raises(RuntimeError, match="boom"):
        with building_on(CPU, torch.bfloat16):
            assert torch.empty(1).dtype == torch.bfloat16
            raise RuntimeError("boom")
    assert torch.get_default_dtype() == torch.float32


def test_a_transformers_model_is_built_on_the_device_in_the_weight_dtype(tmp_path):
    pytest.importorskip("transformers")
    from memtrain.models.hf import HFCausalLM
    from test_hf_models import make_model_dir

    model_dir = make_model_dir(tmp_path, "llama", None)
    cfg = build_config({"model": str(model_dir), "seq_len": 32, "device": "cpu", "attention": "sdpa",
                        "precision": "bf16-pure"})
    model = build_base_model(cfg, torch.device("meta"), make_precision("bf16-pure", CPU))
    assert isinstance(model, HFCausalLM)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_the_result_times_each_phase_before_the_first_step(tiny_run, monkeypatch, capsys):
    """result.json's setup_time_s bills the model's build to `model` (a build made 5 s slower
    shows there, not in the other phases) and keeps the first step's own time; `train` prints it.
    The delay is long beside what the other phases take on a busy 2-core machine (up to 3 s seen)."""
    import re
    import time

    import memtrain.training.train as train_module
    from memtrain.cli import main

    slow = train_module.build_base_model

    def slow_build(*args, **kwargs):
        time.sleep(5.0)
        return slow(*args, **kwargs)

    monkeypatch.setattr(train_module, "build_base_model", slow_build)
    result = train_module.train(build_config(tiny_run), track_memory=False)
    setup = result["setup_time_s"]
    assert set(setup) == {"model", "state", "data", "first_step"}
    assert setup["model"] >= 5.0 and all(0 <= setup[k] < 5.0 for k in ("state", "data")), setup
    assert 0 < setup["first_step"] <= result["total_time_s"]
    monkeypatch.setattr(train_module, "build_base_model", slow)  # the printed line's form needs no slow build
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**tiny_run, "out": tiny_run["out"] + "-cli"}.items()
             if k not in ("dropout", "progress")]
    assert main(["train", *flags, "--no-progress"]) == 0
    assert re.search(r"\nbefore the first step: model \d+\.\d s, techniques and optimizer \d+\.\d s, data \d+\.\d s; "
                     r"the first step took \d+\.\d s\n", capsys.readouterr().out)
