"""fp16's GradScaler in a traced step: over fake tensors its inf check reads no value and used
to skip every optimizer step, so the trace created no optimizer state and its peak fell far
under the measured one (29% at GPT-2's vocabulary). The trace leaves the scaler out (its memory
is scalars) and now matches a measured fp16 step."""

from __future__ import annotations

import pytest

from memtrain.analysis.trace import trace_step
from memtrain.config.run import ConfigError, build_config
from memtrain.training.train import train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_traced_fp16_step_has_optimizer_state_and_matches_the_measured_peak(tiny_run):
    cfg = build_config({**tiny_run, "precision": "fp16", "steps": 3, "warmup_steps": 1})
    try:
        traced = trace_step(cfg, "cpu")
    except ConfigError as exc:  # a torch without CPU float16 autocast refuses fp16 on the CPU
        pytest.skip(str(exc))
    measured = train(cfg)["memory"]
    assert traced["by_category"]["optimizer"] > 0 and traced["phase_peaks"]["optimizer"] > 0
    # The scaler's scale and found-inf scalars are all the trace leaves out.
    assert 0 <= measured["peak_bytes"] - traced["peak_bytes"] <= 64
    assert traced["by_category"]["optimizer"] == measured["by_category"]["optimizer"]
