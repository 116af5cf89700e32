"""``--loss-kernel cce``: the estimate models Cut Cross-Entropy's own buffers (no logits; one
float32 log-sum-exp per token kept; both gradients made in backward in the compute dtype), and
agrees with a trace of the same step, in which memtrain.techniques.loss._CutCrossEntropyBuffers
stands for the library's Triton kernels under fake tensors. The library runs on CUDA only; here
both sides run with CPU facts, which the kernel's buffers do not depend on (the refusal of CUDA-only
kernels off CUDA is lifted for the trace).

With so small a loss, the end of backward is the peak where the head is tied to the embedding:
there autograd sums the two gradients only after the embedding's backward has dropped its output's
gradient (the estimate summed them before: +49 KB on the tied rows below)."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.trace import trace_step
from memtrain.config.run import build_config

# cce_traceable (conftest.py): a stand-in library for every test here
pytestmark = pytest.mark.usefixtures("one_thread", "cce_traceable")

SHAPE = {"batch_size": 3, "seq_len": 40, "device": "cpu", "loss": "chunked", "loss_kernel": "cce"}
OURS = {"d_model": 104, "n_heads": 4, "n_layers": 3, "d_ff": 216, "vocab_size": 5003, "max_seq_len": 64,
        "dropout": 0.0}


# The estimate's forward and backward peaks against the trace's, in bytes. memtrain's own chunked
# loss is within this too (its largest gap here: 14 KB under full checkpointing, in the blocks).
TOLERANCE_BYTES = 16 * 1024


def _gaps(est_peaks: dict, traced: dict) -> dict[str, float]:
    return {phase: est_peaks[phase] - traced["phase_peaks"][phase] for phase in ("forward", "backward")}


@pytest.mark.parametrize("overrides", [
    {"precision": "bf16"},
    {"precision": "fp16"},
    {"precision": "bf16", "checkpointing": "full"},
    {"precision": "bf16", "lora_rank": 8},  # a frozen head: cast and kept, no gradient
    {"precision": "bf16-pure"},
    {"precision": "bf16", "untie_embeddings": True},
    {"precision": "bf16", "grad_accum": 2},
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_our_gpt_with_cce_is_estimated_as_traced(overrides):
    if overrides.get("precision") == "bf16-pure":
        pytest.importorskip("torchao")
    if overrides.get("lora_rank"):
        pytest.importorskip("peft")
    cfg = build_config({**OURS, **SHAPE, **overrides})
    est = estimate(cfg, device_type="cpu")
    traced = trace_step(cfg, "cpu")
    gaps = _gaps(est.phase_peaks, traced)
    assert all(abs(g) <= TOLERANCE_BYTES for g in gaps.values()), gaps


def test_cce_holds_less_than_memtrains_chunked_loss():
    """What the kernel buys, in the estimate: no chunk of logits in forward and no float32 grad_w
    held from forward to backward."""
    cfg = build_config({**OURS, **SHAPE, "precision": "bf16"})
    own = build_config({**OURS, **SHAPE, "precision": "bf16", "loss_kernel": "memtrain"})
    assert estimate(cfg, device_type="cpu").peak_bytes < estimate(own, device_type="cpu").peak_bytes


def test_a_transformers_model_with_cce_is_estimated_as_traced(tmp_path):
    transformers = pytest.importorskip("transformers")
    from memtrain.analysis.estimate.hf import analytic_estimate  # transformers' layers

    transformers.LlamaConfig(hidden_size=104, intermediate_size=216, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=128,
                             vocab_size=3001).save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), **SHAPE, "precision": "bf16", "attention": "sdpa"})
    gaps = _gaps(analytic_estimate(cfg, "cpu").phase_peaks, trace_step(cfg, "cpu"))
    assert all(abs(g) <= TOLERANCE_BYTES for g in gaps.values()), gaps
