"""LayerNorm's saved mean and rstd on the CPU are in its input's dtype where the weights share it
(bf16-pure: 2 bytes per token each), float32 under autocast (which runs it in float32). The
estimate counted float32 statistics under bf16-pure: +1.4% forward and backward over the trace on
a deep narrow model (7 layers of width 12, 3 x 23 tokens), where two norms per layer weigh."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.trace import trace_step
from memtrain.config.run import build_config

pytestmark = pytest.mark.usefixtures("one_thread")

NARROW = {"batch_size": 3, "seq_len": 23, "attention": "math", "checkpointing": "selective", "grad_accum": 2,
          "device": "cpu", "vocab_size": 33, "d_model": 12, "n_heads": 2, "n_layers": 7, "d_ff": 30, "max_seq_len": 64,
          "dropout": 0.1, "untie_embeddings": True, "window": 16}


@pytest.mark.parametrize("precision", ["bf16-pure", "bf16"])
def test_layernorm_statistics_in_the_input_dtype(precision):
    cfg = build_config({**NARROW, "precision": precision})
    mine, traced = estimate(cfg, device_type="cpu").phase_peaks, trace_step(cfg, "cpu")["phase_peaks"]
    for phase in ("forward", "backward"):  # (bf16-pure's optimizer phase: tests/test_estimate_bf16_pure_step.py)
        assert abs(mine[phase] / traced[phase] - 1) < 0.01, (phase, mine, traced)
