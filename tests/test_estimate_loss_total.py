"""The step's 0-d float32 loss in the estimate's timeline: with one micro-batch train_step keeps
the loss module's own output as the step's loss, so the 4 bytes appear with the loss, not before
the forward (the estimate counted them from the start of the step: 4 B above the trace in the
forward of every one-micro-batch step). The chunked loss's 0-d ``1 / n_valid`` is saved for its
backward beside its float32 accumulator (4 B below the trace in its forward)."""

from __future__ import annotations

import pytest

from memtrain.config.run import build_config

TINY = dict(vocab_size=512, d_model=32, n_heads=2, n_layers=2, d_ff=64, max_seq_len=64, dropout=0.0,
            batch_size=2, seq_len=32, device="cpu")


@pytest.mark.parametrize("loss_on", ["all", "completion"])
@pytest.mark.parametrize("loss", ["standard", "chunked", "naive"])
def test_a_one_micro_batch_forward_peaks_at_the_traced_bytes(loss, loss_on):
    from memtrain.analysis.estimate import estimate
    from memtrain.analysis.trace import trace_step

    cfg = build_config(dict(TINY, loss=loss, loss_on=loss_on))
    assert cfg.train.grad_accum == 1
    mine = estimate(cfg, device_type="cpu").phase_peaks["forward"]
    assert mine == trace_step(cfg, "cpu")["phase_peaks"]["forward"]


def test_the_step_keeps_the_loss_nodes_output_only_with_one_micro_batch():
    from memtrain.analysis.estimate.head_nodes import LOSS, WEIGHTED_LOSS
    from memtrain.analysis.estimate.training import step_loss_key

    cfg = build_config(TINY)
    assert step_loss_key(cfg) == LOSS
    assert step_loss_key(cfg.replace(loss_on="completion")) == WEIGHTED_LOSS
    assert step_loss_key(cfg.replace(grad_accum=2)) is None  # accumulation copies the first loss
