"""LoRA on a bf16-pure base (our GPT): peft adds the float32 adapter product to the bf16 base
output, which promotes the sum to float32, and casts it back. In backward the add casts the sum's
gradient down for the base, a new tensor beside the adapters' gradient, and a checkpointed
block's lazy recompute starts after it. The estimate cast the product down before a bf16 add,
whose gradient passed through: backward -1.3% (window 2, 3 x 23 tokens, every:3) and -1.0%
(window 2, 5 x 2 tokens, sqrt, lora_dropout) under the trace."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.trace import trace_step
from memtrain.config.run import build_config

pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    {"batch_size": 3, "seq_len": 23, "attention": "math", "checkpointing": "every:3", "loss": "standard",
     "lora_rank": 4, "vocab_size": 97, "d_model": 18, "n_heads": 3, "n_layers": 1, "d_ff": 54, "dropout": 0.0,
     "untie_embeddings": True, "window": 2},
    {"batch_size": 5, "seq_len": 2, "attention": "sdpa", "checkpointing": "sqrt", "loss": "standard", "grad_accum": 3,
     "lora_rank": 1, "lora_dropout": 0.1, "vocab_size": 17, "d_model": 20, "n_heads": 2, "n_layers": 1, "d_ff": 60,
     "dropout": 0.0, "untie_embeddings": False, "window": 2},
]


@pytest.mark.parametrize("case", CASES, ids=["math-every3", "sdpa-sqrt-lora_dropout"])
def test_bf16_pure_lora_sum_is_float32(case):
    cfg = build_config({**case, "precision": "bf16-pure", "max_seq_len": 64, "device": "cpu"})
    mine, traced = estimate(cfg, device_type="cpu").phase_peaks, trace_step(cfg, "cpu")["phase_peaks"]
    for phase in ("forward", "backward"):  # (bf16-pure's optimizer phase: tests/test_estimate_bf16_pure_step.py)
        assert abs(mine[phase] / traced[phase] - 1) < 0.01, (phase, mine, traced)
