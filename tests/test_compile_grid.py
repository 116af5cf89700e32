"""Every technique combines with ``--compile``: a run built with the technique and compiled trains
the same losses as the eager run, in one graph, with no graph break.

The run is built as ``memtrain train`` builds it (:func:`memtrain.training.step.build_state`: the
techniques in their one order, compile last) and stepped by the step harness. The graphs are traced
with the ``aot_eager`` backend (dynamo and AOTAutograd: what must understand each technique) instead
of inductor, whose C++ kernels take minutes to build on two cores; tests/test_compile.py runs
inductor itself (slow). FlexAttention needs CUDA for its backward and is left to the GPU tests.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

import memtrain.techniques.hf_mapping as hf_mapping
import memtrain.techniques.order as order
from memtrain.config.run import build_config
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.precision import make_precision
from memtrain.training.step import build_state, random_micro_batches, run_step

CPU = torch.device("cpu")
TINY_GPT = {"vocab_size": 512, "d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_seq_len": 64,
            "dropout": 0.0}
RUN = {"batch_size": 2, "seq_len": 32, "device": "cpu"}

TECHNIQUES = {
    "window": {"attention": "sdpa", "window": 8},
    "math-attention": {"attention": "math"},
    "checkpointing-every-2": {"checkpointing": "every:2"},
    "checkpointing-sqrt": {"checkpointing": "sqrt"},
    "checkpointing-selective": {"checkpointing": "selective"},
    "checkpointing-selective-matmul": {"checkpointing": "selective-matmul"},
    "chunked-loss": {"loss": "chunked", "loss_chunk": 16},
    "grad-accum": {"grad_accum": 2},
    "lora": {"lora_rank": 4},
    "adafactor": {"optim": "adafactor"},
    "bf16-autocast": {"precision": "bf16"},
    "offload-activations": {"offload_activations": True},
    "block-scope-window-checkpointing": {"compile_scope": "block", "attention": "sdpa", "window": 8,
                                         "checkpointing": "full"},
}


@pytest.fixture(autouse=True)
def _aot_eager(monkeypatch):
    """Compile with aot_eager wherever a run compiles (memtrain's GPT and transformers models)."""
    for module in (order, hf_mapping):
        monkeypatch.setattr(module, "apply_compile", functools.partial(apply_compile, backend="aot_eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _three_steps(settings: dict, compiled: bool) -> tuple[list[float], dict, int]:
    """Losses of three steps on fixed random batches; the graph breaks and graphs dynamo made."""
    torch._dynamo.reset()
    counters.clear()
    cfg = build_config({**RUN, **settings, "compile": compiled})
    torch.manual_seed(0)
    state = build_state(cfg, CPU, make_precision(cfg.technique.precision, CPU))
    generator = torch.Generator().manual_seed(1)
    losses = [run_step(state, random_micro_batches(cfg, cfg.train.batch_size, CPU, generator)) for _ in range(3)]
    return losses, dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


def _assert_compiled_matches_eager(settings: dict) -> None:
    eager, _, _ = _three_steps(settings, compiled=False)
    compiled, breaks, graphs = _three_steps(settings, compiled=True)
    assert breaks == {}, breaks
    assert graphs == 1, f"{graphs} graphs: the model should compile to one (block scope: one shared by the blocks)"
    tolerance = 1e-3 if settings.get("precision") == "bf16" else 1e-5
    torch.testing.assert_close(compiled, eager, rtol=tolerance, atol=tolerance)
    assert eager[2] != eager[0]  # the steps trained: a frozen model would match trivially


@pytest.mark.parametrize("name", list(TECHNIQUES))
def test_each_technique_compiles_with_no_graph_break_and_trains_as_eager(name):
    _assert_compiled_matches_eager({**TINY_GPT, **TECHNIQUES[name]})


@pytest.mark.parametrize("settings", [{}, {"lora_rank": 4}, {"checkpointing": "full", "loss": "chunked", "loss_chunk": 16}],
                         ids=["full", "lora", "checkpointing-chunked"])
def test_a_transformers_model_compiles_with_each_technique(settings, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=64).save_pretrained(tmp_path)
    _assert_compiled_matches_eager({"model": str(tmp_path), **settings})
