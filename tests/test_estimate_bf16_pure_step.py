"""The optimizer step of ``--precision bf16-pure``: torchao's stochastic-rounding AdamW, whose
step torch.compile turns into one fused kernel per parameter. A real steady-state CPU step
(MemoryMeter) holds no scratch above the optimizer state, so the analytic estimate adds none;
the fake-tensor trace runs that step eagerly and says its optimizer phase is an upper bound."""

from __future__ import annotations

import json

import pytest

from memtrain.analysis.estimate import estimate
from memtrain.analysis.maxbatch import measure_step_memory
from memtrain.cli import main
from memtrain.config.run import build_config

pytest.importorskip("torchao")

# Tiny models: one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

# Batch 1 x 8 tokens: the activations are small next to the parameters, so a step scratch of
# the plain AdamW rule (previous + 2 x current parameter) made the optimizer step the peak.
SHAPES = {
    "gpt-v97-d40": dict(vocab_size=97, d_model=40, n_heads=2, n_layers=2, d_ff=160, max_seq_len=64),
    # The largest parameter (a 4096 x 64 untied head) dwarfs the activations.
    "gpt-v4096-untied": dict(vocab_size=4096, d_model=64, n_heads=2, n_layers=2, d_ff=128, max_seq_len=64,
                             untie_embeddings=True),
    "tiny-llama": dict(model="tiny-llama"),
}


def _config(shape: str):
    if shape == "tiny-llama":
        pytest.importorskip("transformers")
    return build_config(dict(SHAPES[shape], device="cpu", precision="bf16-pure", dropout=0.0,
                             batch_size=1, seq_len=8))


@pytest.mark.parametrize("shape", ["gpt-v97-d40", "gpt-v4096-untied",
                                   pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_bf16_pure_estimate_matches_the_measured_compiled_step(shape):
    cfg = _config(shape)
    measured = measure_step_memory(cfg, cfg.train.batch_size)  # the steady (second) step
    assert measured is not None
    est = estimate(cfg, device_type="cpu")
    # The real step stays within a few hundred bytes of the state, below the backward peak here.
    state = sum(measured["by_category"][c] for c in ("parameters", "gradients", "optimizer"))
    assert measured["phase_peaks"]["optimizer"] - state < 1024, measured
    assert est.phase_peaks["optimizer"] == pytest.approx(measured["phase_peaks"]["optimizer"], rel=0.01), \
        (est.phase_peaks, measured["phase_peaks"])
    assert est.peak_bytes == pytest.approx(measured["peak_bytes"], rel=0.01), (est.phase_peaks, measured)
    # The estimate's optimizer step adds nothing above the state, so it is not its peak.
    assert est.peak_phase == measured["peak_phase"] == "backward"


def test_the_trace_says_its_bf16_pure_optimizer_step_ran_eagerly(capsys):
    shape = SHAPES["gpt-v97-d40"]
    args = ["estimate", "--vocab-size", str(shape["vocab_size"]), "--d-model", str(shape["d_model"]),
            "--n-heads", "2", "--n-layers", "2", "--d-ff", "160", "--batch-size", "1", "--seq-len", "8",
            "--dropout", "0", "--device", "cpu", "--precision", "bf16-pure", "--trace"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "traced eagerly" in out["trace"]["optimizer_step"]
    # Eager, the step's FP32 temporaries make the traced peak the optimizer step, above the estimate.
    assert out["trace"]["peak_phase"] == "optimizer"
    assert out["trace"]["peak_bytes"] > out["peak_bytes"]
    assert main(args) == 0
    assert "optimizer step traced eagerly: an upper bound" in capsys.readouterr().out
    # torch's own AdamW (fp32) is traced as it runs: no such note.
    assert main(args[:-3] + ["--trace", "--json"]) == 0
    assert "optimizer_step" not in json.loads(capsys.readouterr().out)["trace"]


@pytest.mark.parametrize("optim,precision", [("adamw", "bf16-pure"), ("adamw-fused", "fp32"),
                                             ("adamw-8bit", "fp32")])
def test_a_step_without_scratch_holds_the_weights_gradients_and_state(optim, precision):
    """An optimizer step that adds no scratch still has its phase peak in the estimate: all that
    is live there (``phase_peaks`` of ``estimate --json``)."""
    cfg = build_config(dict(SHAPES["gpt-v97-d40"], device="cpu", optim=optim, precision=precision, dropout=0.0,
                            batch_size=1, seq_len=8))
    est = estimate(cfg, device_type="cpu")
    state = est.extra["model_state"]
    assert state["optimizer_step_scratch"] == 0
    assert est.phase_peaks["optimizer"] == state["weights"] + state["gradients"] + state["optimizer"]
