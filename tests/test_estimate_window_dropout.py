"""A sliding window narrower than the sequence with dropout on the CPU: SDPA's fused CPU kernel
has no dropout, so each band runs SDPA's math path, whose buffers are memtrain's banded math
kernel's. The estimate modelled the fused banded kernel there (-2.1% at 2 x 32, window 8)."""

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
def test_windowed_attention_with_dropout_on_cpu(attention):
    assert abs(_gap(attention=attention)) < 0.01


@pytest.mark.xfail(strict=True, reason="under bf16 autocast SDPA's math path upcasts each band to float32; "
                                       "the estimate counts the bf16 math kernel's band (-2.2%)")
def test_windowed_sdpa_with_dropout_under_bf16_autocast():
    assert abs(_gap(attention="sdpa", precision="bf16")) < 0.01
