"""torch.compile across training steps: a compiled model is captured once and reused by every step.

Dynamo specialises a compiled frame on the Python numbers it is called with and recompiles when
one changes. Under ``--loss-on completion`` each micro-batch's weight (its share of the step's
answer tokens, ``MicroBatches.loss_scales``) changes every step, and the losses of several steps
are read from the device together (``memtrain.training.readings``); neither may reach a compiled
frame as a Python number. These tests count dynamo's frames with a counting backend (aot_eager
beneath it: dynamo and AOTAutograd as inductor sees them, without building kernels) instead of
timing anything.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from conftest import TINY_MODEL
from memtrain.config.run import ModelConfig, TechniqueConfig, build_config
from memtrain.data.loader import IGNORE_INDEX, MicroBatches, host_target_count
from memtrain.models.gpt import GPT
from memtrain.techniques import make_precision
from memtrain.techniques.compile import apply_compile
from memtrain.techniques.loss import apply_loss
from memtrain.training.step import build_state, train_step

CPU = torch.device("cpu")
VOCAB = 256


pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # conftest.py: counts are each test's own


def _answer_steps(steps: int, accum: int = 3, seq: int = 16) -> list[MicroBatches]:
    """``steps`` groups of ``accum`` micro-batches whose answer-token counts differ from step to
    step (one micro-batch holds none), with their host counts as the loader gives them."""
    g = torch.Generator().manual_seed(7)
    out = []
    for s in range(steps):
        group = MicroBatches()
        for i in range(accum):
            x = torch.randint(0, VOCAB, (2, seq), generator=g)
            y = torch.randint(0, VOCAB, (2, seq), generator=g)
            keep = 0 if (s, i) == (1, 2) else 3 + 5 * s + 2 * i  # a prompt-only micro-batch at step 2
            y.view(-1)[keep:] = IGNORE_INDEX
            group.append((x, y))
        group.target_counts = [host_target_count(y) for _, y in group]
        out.append(group)
    return out


def _answers_model(family: str, loss: str, tmp_path) -> torch.nn.Module:
    """A tiny model of ``family`` training on answers only (--loss-on completion), uncompiled:
    our GPT (d_model 32) or a config-only transformers Llama of the same width."""
    torch.manual_seed(0)
    if family == "gpt":
        model = GPT(ModelConfig(**{**TINY_MODEL, "vocab_size": VOCAB}))
        apply_loss(model, _tech(loss), CPU)
        model.answers_only = True  # what prepare_model sets for --loss-on completion
        return model
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tiny-llama"
    transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=64).save_pretrained(folder)
    records = tmp_path / "pc.jsonl"  # never read: the config checks that records are given
    cfg = build_config({"model": str(folder), "data": str(records), "data_format": "prompt-completion",
                        "loss_on": "completion", "loss": loss, "loss_chunk": 8, "dropout": 0.0, "seq_len": 16})
    model = build_state(cfg, CPU).model
    assert model.answers_only
    return model


def _tech(loss: str) -> TechniqueConfig:
    return TechniqueConfig(compile=True, loss=loss, loss_chunk=8)


def _train(model: torch.nn.Module, groups: list[MicroBatches], after_step=lambda: None) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    precision = make_precision("fp32", CPU)
    losses = []
    for group in groups:
        losses.append(train_step(model, group, opt, precision, 1.0, CPU))
        after_step()
    return losses


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("loss", ["standard", "chunked"])
def test_answer_weights_that_change_every_step_compile_once(family, loss, tmp_path):
    """--loss-on completion, --grad-accum 3, standard and chunked loss, our GPT and a transformers
    Llama: micro-batch weights that differ at every step (and a micro-batch without an answer) leave
    one compiled frame, captured at the first step, with no graph break and no recompile; the losses
    are the eager model's."""
    eager = _answers_model(family, loss, tmp_path)
    compiled = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("aot_eager")
    apply_compile(compiled, _tech(loss), backend=counter)
    groups = _answer_steps(4)
    scales = [tuple(g.loss_scales(CPU)) for g in groups]
    assert len(set(scales)) == len(scales), "the steps' weights must differ for this test to mean anything"

    frames: list[int] = []
    got = _train(compiled, groups, lambda: frames.append(counter.frame_count))
    want = _train(eager, copy.deepcopy(groups))

    assert frames == [1] * len(groups), frames
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_text_run_with_steps_read_together_compiles_once(tiny_run, monkeypatch):
    """Text data, 5 compiled steps whose losses stay on the device and are read together at the
    metrics lines (the GPU loop, run here on the CPU): one frame from the first step to the last,
    and the losses are the uncompiled run's."""
    from memtrain.techniques import order
    from memtrain.training import train as train_mod

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(order, "apply_compile", functools.partial(apply_compile, backend=counter))
    monkeypatch.setattr(train_mod, "overlaps_steps", lambda *a: True)  # queue steps, read per metrics line
    run = {**tiny_run, "steps": 5, "log_every": 2, "warmup_timing_steps": 1}
    frames: list[int] = []
    compiled = train_mod.train(build_config({**run, "compile": True}), track_memory=False,
                               on_step=lambda *a: frames.append(counter.frame_count))
    eager = train_mod.train(build_config({**run, "out": run["out"] + "-eager"}), track_memory=False)

    assert frames == [1] * 5, frames
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert compiled["loss_history"] == pytest.approx(eager["loss_history"], rel=1e-5)


def test_evaluations_of_a_compiled_run_compile_nothing_more(tiny_run, monkeypatch):
    """--compile with --eval-every: the evaluations (every 2 steps and at the end, in eval mode and
    without gradients, a smaller last batch among them) run the model uncompiled, as HF Trainer
    evaluates its own, so the run compiles its training graph once and nothing else (a second
    graph, and a third for the smaller batch, cost 27 s of compiling on a CPU for the seed GPT),
    and its validation losses are the uncompiled run's."""
    from memtrain.techniques import order
    from memtrain.training import train as train_mod

    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(order, "apply_compile", functools.partial(apply_compile, backend=counter))
    # 5 validation blocks at batch 4: a full batch and a smaller last one
    run = {**tiny_run, "steps": 4, "eval_every": 2, "val_blocks": 5, "warmup_timing_steps": 1}
    frames: list[int] = []
    compiled = train_mod.train(build_config({**run, "compile": True}), track_memory=False,
                               on_step=lambda *a: frames.append(counter.frame_count))
    eager = train_mod.train(build_config({**run, "out": run["out"] + "-eager"}), track_memory=False)

    assert frames == [1] * 4, frames  # the evaluation after step 2 compiled nothing
    assert counter.frame_count == 1  # nor did the final one
    assert [v["step"] for v in compiled["val_history"]] == [2]
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-5)
    assert [v["val_loss"] for v in compiled["val_history"]] == pytest.approx(
        [v["val_loss"] for v in eager["val_history"]], rel=1e-5)
