"""The analytic estimate of our GPT and of transformers layers under ``--lora-dropout``: peft
drops each adapter's input before lora_A, whose matmul saves the dropped copy, and the dropout
keeps its mask. Checked against the fake-tensor trace of the same step on tiny models."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.config.run import build_config

pytest.importorskip("peft")

# Tiny models: one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

# Activations weigh enough here for the dropped copies and masks to move the peak by ~2%.
TINY_LORA = dict(vocab_size=4096, d_model=32, n_heads=2, n_layers=2, d_ff=64, batch_size=4, seq_len=64,
                 device="cpu", lora_rank=8)


def _peaks(**overrides) -> tuple[float, int]:
    """(analytic, traced) peak bytes of one CPU training step."""
    from memtrain.analysis.trace import trace_step

    cfg = build_config(dict(TINY_LORA, **overrides))
    return estimate(cfg, device_type="cpu").peak_bytes, trace_step(cfg, "cpu")["peak_bytes"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_lora_dropout_estimate_within_one_percent_of_the_trace(precision, checkpointing):
    est, traced = _peaks(precision=precision, checkpointing=checkpointing, lora_dropout=0.1)
    assert est == pytest.approx(traced, rel=0.01)
    # What the dropout adds to the peak is the trace's to the byte: every block's masks (the
    # dropped copies replace the inputs lora_A saved) without checkpointing; nothing under full
    # checkpointing, whose peak does not fall inside a block's recompute here.
    est0, traced0 = _peaks(precision=precision, checkpointing=checkpointing, lora_dropout=0.0)
    assert est - est0 == traced - traced0
    if checkpointing == "none":
        assert traced > traced0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_transformers_lora_dropout_is_answered_analytically_within_one_percent(tmp_path, precision):
    transformers = pytest.importorskip("transformers")
    from memtrain.analysis.estimate.hf import analytic_estimate, why_not_modelled
    from memtrain.analysis.trace import trace_step

    transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128, vocab_size=384
                             ).save_pretrained(tmp_path)
    peaks = []
    for dropout in (0.0, 0.1):
        cfg = build_config({"model": str(tmp_path), "batch_size": 4, "seq_len": 64, "attention": "sdpa",
                            "device": "cpu", "precision": precision, "lora_rank": 4, "lora_dropout": dropout})
        assert why_not_modelled(cfg) is None
        est = analytic_estimate(cfg, "cpu")
        assert est is not None
        peaks.append((est.peak_bytes, trace_step(cfg, "cpu")["peak_bytes"]))
    (est0, traced0), (est, traced) = peaks
    assert est == pytest.approx(traced, rel=0.01)
    assert traced > traced0 and est - est0 == traced - traced0
