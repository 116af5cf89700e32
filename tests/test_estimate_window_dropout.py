"""A sliding window narrower than the sequence with dropout on the CPU: SDPA's fused CPU kernel
has no dropout, so each band runs SDPA's math path, whose buffers are memtrain's banded math
kernel's, in float32 (it upcasts a bf16 band and casts its output back). The estimate modelled
the fused banded kernel there (-2.1% at 2 x 32, window 8; -3.5% under bf16 autocast)."""

from __future__ import annotations

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.trace import trace_step
from memtrain.config.run import build_config

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = {"d_model": 64, "n_heads": 4, "n_layers": 3, "d_ff": 160, "vocab_size": 3001, "max_seq_len": 64,
        "batch_size": 2, "seq_len": 32, "device": "cpu", "window": 8, "dropout": 0.1}


def _gap(**kw) -> float:
    cfg = build_config({**BASE, **kw})
    return estimate(cfg, device_type="cpu").peak_bytes / trace_step(cfg, "cpu")["peak_bytes"] - 1


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_windowed_attention_with_dropout_on_cpu(attention, precision):
    assert abs(_gap(attention=attention, precision=precision)) < 0.01


def test_windowed_sdpa_with_dropout_other_shapes():
    """An odd width and head count, a window of 12 over 48 tokens, under checkpointing and LoRA."""
    shape = dict(d_model=72, n_heads=6, n_layers=2, d_ff=200, vocab_size=2011, batch_size=3, seq_len=48, window=12)
    for extra in (dict(checkpointing="full"), dict(lora_rank=4)):
        assert abs(_gap(attention="sdpa", precision="bf16", **shape, **extra)) < 0.01


def _phase_gaps(**kw) -> dict[str, float]:
    """estimate / trace - 1 of each phase's peak (forward, backward, optimizer)."""
    cfg = build_config({**BASE, **kw})
    mine, traced = estimate(cfg, device_type="cpu").phase_peaks, trace_step(cfg, "cpu")["phase_peaks"]
    return {ph: mine[ph] / traced[ph] - 1 for ph in ("forward", "backward", "optimizer")}


# A checkpointed block's forward saves nothing, so its peak is inside the banded kernel, whose
# locals (the padded q, k and v, the bool band mask, the math kernel's masked scores) live until
# it returns; the math kernel's second matmul copies v's band only after the softmax and the
# dropout. The estimate freed the locals as soon as they were read and copied v's band first:
# forward -10.6% (SDPA, LoRA with lora_dropout) and -23.7% (math), batch 5 x 40 tokens, window 16.
BANDED_CHECKPOINTED = [dict(attention="sdpa", precision="fp32", lora_rank=4, lora_dropout=0.1),
                       dict(attention="math", precision="fp32"),
                       dict(attention="math", precision="bf16", n_layers=3, checkpointing="every:2")]


@pytest.mark.parametrize("extra", BANDED_CHECKPOINTED, ids=lambda e: "-".join(f"{k}_{v}" for k, v in e.items()))
def test_a_checkpointed_banded_kernel_holds_its_locals(extra):
    shape = dict(d_model=8, n_heads=2, n_layers=1, d_ff=22, vocab_size=33, batch_size=5, seq_len=40, window=16,
                 untie_embeddings=True)
    gaps = _phase_gaps(**{**shape, "checkpointing": "full", **extra})
    assert all(abs(g) < 0.01 for g in gaps.values()), gaps


# A window too wide to band (block + window - 1 >= seq: 16 over 23 tokens) runs the dense masked
# form: --attention sdpa without dropout hands SDPA the bool window mask, and torch's CPU flash
# kernel keeps a float copy of it beside q, k, v, its output and the log-sum-exp, no (b, h, s, s)
# scores. The estimate counted SDPA's math path there: +4.7% forward (bf16 autocast), +2.1% (fp32).
DENSE_WINDOW = [dict(precision="bf16"), dict(precision="fp32"), dict(precision="bf16-pure", n_heads=1, batch_size=1),
                dict(precision="fp16", n_layers=3, checkpointing="full")]


@pytest.mark.parametrize("extra", DENSE_WINDOW, ids=lambda e: "-".join(f"{k}_{v}" for k, v in e.items()))
def test_a_window_too_wide_to_band_runs_the_cpu_flash_kernel(extra):
    shape = dict(d_model=28, n_heads=2, n_layers=1, d_ff=62, vocab_size=301, batch_size=3, seq_len=23, window=16,
                 dropout=0.0, attention="sdpa", loss="chunked", loss_chunk=7, untie_embeddings=True)
    gaps = _phase_gaps(**{**shape, **extra})
    assert all(abs(g) < 0.01 for g in gaps.values()), gaps


# SDPA's math path over the bands (the CPU with dropout): F.pad copies q, k and v in their own
# dtype, on 16-bit inputs the math path casts q and the k and v bands to float32 copies; it scales q,
# and adds the band mask in q's dtype, all alive until it returns (the checkpointed block's
# forward peak); with q unpadded (40 tokens in blocks of 5) folding (batch, heads) copies the
# padded q, and at batch 1 the matmul copies the scaled q instead. The estimate counted the pads in
# float32 and none of the copies: fp16 -5.0% forward, -5.5% backward (batch 3 x 40, window 5). In
# float32 (no casts) it copied neither the scaled q nor, where unpadded, the folded q: -1.5%
# forward (2 x 9 tokens, 5 heads, window 3, full checkpointing).
BANDED_SDPA_MATH = [dict(precision="fp16"), dict(precision="bf16"), dict(precision="bf16-pure"),
                    dict(precision="fp16", batch_size=1), dict(precision="bf16", checkpointing="none", batch_size=1),
                    dict(precision="fp16", seq_len=23, n_layers=3, checkpointing="every:2"),
                    dict(precision="fp32", batch_size=2, seq_len=9, window=3, n_heads=5, d_model=30),
                    dict(precision="fp32", batch_size=1, seq_len=9, window=3, n_heads=5, d_model=30)]


@pytest.mark.parametrize("extra", BANDED_SDPA_MATH, ids=lambda e: "-".join(f"{k}_{v}" for k, v in e.items()))
def test_banded_sdpa_math_path(extra):
    shape = dict(d_model=30, n_heads=3, n_layers=2, d_ff=32, vocab_size=33, batch_size=3, seq_len=40, window=5,
                 attention="sdpa", checkpointing="full", loss="chunked", loss_chunk=50)
    gaps = _phase_gaps(**{**shape, **extra})
    assert all(abs(g) < 0.01 for g in gaps.values()), gaps


# The dense window's mask under the CPU flash kernel: causal_mask peaks at ``i - j < window`` (two
# int64 aranges, the int64 difference, the causal bool and the comparison), and the bool mask it
# returns lives beside SDPA's float copy until SDPA returns. The estimate made the float copy
# beside all of causal_mask's temporaries: +3.1% forward, +3.3% backward (bf16-pure, 1 x 23
# tokens, one head of 6, window 16, full checkpointing).
def test_the_dense_window_mask_peaks_inside_causal_mask():
    gaps = _phase_gaps(d_model=6, n_heads=1, n_layers=7, d_ff=18, vocab_size=17, batch_size=1, seq_len=23,
                       window=16, dropout=0.0, attention="sdpa", precision="bf16-pure", checkpointing="full",
                       grad_accum=2, untie_embeddings=False)
    assert abs(gaps["forward"]) < 0.01 and abs(gaps["backward"]) < 0.01, gaps
