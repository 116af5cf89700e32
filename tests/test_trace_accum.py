"""A traced step runs at most two micro-batches (memtrain.analysis.trace.TRACED_MICRO_BATCHES):
from the second on every gradient exists and each micro-batch repeats the same shapes. The
capped trace must report what tracing every micro-batch reports: every peak, every category,
the phase, and --offload-activations' per-step bytes (scaled back to the whole step)."""

from __future__ import annotations

import pytest

import memtrain.analysis.trace as trace_module
from conftest import TINY_MODEL
from memtrain.analysis.trace import trace_step
from memtrain.config.run import build_config

RUN = {**TINY_MODEL, "batch_size": 2, "seq_len": 32, "grad_accum": 5, "device": "cpu"}
KEYS = ("peak_bytes", "peak_phase", "by_category", "category_peaks", "phase_peaks", "current_bytes", "offload")


def _both(cfg, monkeypatch) -> tuple[dict, dict]:
    """(the capped trace, the trace of every micro-batch)."""
    ran: list[int] = []  # micro-batches each traced step ran
    real = trace_module.measure_steps

    def counting(state, make_micro, **kw):
        return real(state, lambda: (lambda m: ran.append(len(m)) or m)(make_micro()), **kw)

    monkeypatch.setattr(trace_module, "measure_steps", counting)
    capped = trace_step(cfg)
    assert ran == [trace_module.TRACED_MICRO_BATCHES] * 2  # two steps, two micro-batches each
    monkeypatch.setattr(trace_module, "TRACED_MICRO_BATCHES", 100)
    full = trace_step(cfg)
    assert ran[2:] == [cfg.train.grad_accum] * 2
    return capped, full


@pytest.mark.parametrize("tech", [
    {},
    {"precision": "bf16", "checkpointing": "full", "dropout": 0.1},
    {"loss": "naive", "optim": "adafactor"},
    {"loss": "chunked", "loss_chunk": 16, "checkpointing": "every:2"},
    {"offload_activations": True, "attention": "math"},
    {"lora_rank": 4},
], ids=["fp32", "bf16-ckpt-dropout", "naive-adafactor", "chunked-every2", "offload", "lora"])
def test_a_capped_trace_equals_the_trace_of_every_micro_batch(tech, monkeypatch):
    cfg = build_config({**RUN, **tech})
    capped, full = _both(cfg, monkeypatch)
    assert {k: capped.get(k) for k in KEYS} == {k: full.get(k) for k in KEYS}
    if tech.get("offload_activations"):
        assert full["offload"]["d2h_bytes"] > 0


def test_a_capped_trace_of_a_transformers_model_equals_the_full_one(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=64).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), "batch_size": 2, "seq_len": 32, "grad_accum": 4,
                        "lora_rank": 4, "checkpointing": "full", "device": "cpu"})
    capped, full = _both(cfg, monkeypatch)
    assert {k: capped.get(k) for k in KEYS} == {k: full.get(k) for k in KEYS}
