"""The optimizer step of ``--precision bf16-pure``: torchao's stochastic-rounding AdamW, which
memtrain calls once per bucket of small tensors (memtrain.techniques.sr_adamw), each call one
fused compiled kernel. A real steady-state CPU step (MemoryMeter) holds four copies of the
largest bucket above the optimizer state (weights, gradients, both moments) and nothing else, as
the analytic estimate says; the fake-tensor trace runs that step eagerly and says its optimizer
phase is an upper bound."""

from __future__ import annotations

import json

import pytest
import torch

from memtrain.analysis.estimate import estimate
from memtrain.analysis.estimate.method import estimate_step, model_arch
from memtrain.analysis.maxbatch import measure_step_memory
from memtrain.cli import main
from memtrain.config.run import build_config
from memtrain.models.families import build_model
from memtrain.techniques.facts import sr_adamw_scratch_numel

pytest.importorskip("torchao")

# Tiny models: one thread (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

# Batch 1 x 8 tokens: the activations are small next to the parameters, so the optimizer step's
# scratch decides whether it is the peak (the plain AdamW rule, previous + 2 x current parameter,
# put it 2-23% above the measured peak).
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


def _analytic(cfg):
    """The analytic estimate with the model's own architecture (a transformers Llama's for tiny-llama)."""
    est = estimate_step(cfg, "cpu", model_arch(cfg)).analytic
    assert est is not None
    return est


def _bucket_scratch(cfg) -> int:
    """Four BF16 copies of the largest bucket, planned over the real model's param groups."""
    model = build_model(cfg, with_weights=False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    worst = max(sr_adamw_scratch_numel([p.numel() for p in trainable if p.dim() >= 2]),
                sr_adamw_scratch_numel([p.numel() for p in trainable if p.dim() < 2]))
    return 4 * 2 * worst


@pytest.mark.parametrize("shape", ["gpt-v97-d40", "gpt-v4096-untied",
                                   pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_bf16_pure_estimate_matches_the_measured_compiled_step(shape):
    cfg = _config(shape)
    measured = measure_step_memory(cfg, cfg.train.batch_size)  # the steady (second) step
    assert measured is not None
    est = _analytic(cfg)
    scratch = _bucket_scratch(cfg)
    assert scratch > 0  # every tensor of these models fits a bucket
    # The real step holds the state, the bucket's four copies and a few hundred bytes more.
    state = sum(measured["by_category"][c] for c in ("parameters", "gradients", "optimizer"))
    assert 0 <= measured["phase_peaks"]["optimizer"] - state - scratch < 1024, (measured, scratch)
    assert est.extra["model_state"]["optimizer_step_scratch"] == scratch
    assert est.phase_peaks["optimizer"] == pytest.approx(measured["phase_peaks"]["optimizer"], rel=0.01), \
        (est.phase_peaks, measured["phase_peaks"])
    assert est.peak_bytes == pytest.approx(measured["peak_bytes"], rel=0.01), (est.phase_peaks, measured)
    # With activations this small, the copies (8 bytes a weight) make the step the peak, in both.
    assert est.peak_phase == measured["peak_phase"] == "optimizer"


def _estimate_args(vocab: int) -> list[str]:
    shape = SHAPES["gpt-v97-d40"]
    return ["estimate", "--vocab-size", str(vocab), "--d-model", str(shape["d_model"]),
            "--n-heads", "2", "--n-layers", "2", "--d-ff", "160", "--batch-size", "1", "--seq-len", "8",
            "--dropout", "0", "--device", "cpu", "--precision", "bf16-pure", "--trace"]


def test_a_trace_of_a_tensor_updated_alone_holds_what_the_compiled_step_holds(capsys):
    """At vocab 26,215 x d_model 40 the embedding holds 1,048,600 values, above the bucketing
    threshold, so torchao's compiled kernel updates it alone, in place: the trace makes its state
    without running that update eagerly (whose float32 temporaries made the traced step 2.6-2.8x
    the real one's on such models), so it is no upper bound (no note) and agrees with the
    estimate in every phase, the optimizer step's included."""
    args = _estimate_args(26_215)
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "optimizer_step" not in out["trace"]
    assert abs(out["trace"]["peak_bytes"] / out["peak_bytes"] - 1) < 0.01
    assert out["trace"]["peak_phase"] == out["peak_phase"]
    assert main(args) == 0
    assert "traced eagerly" not in capsys.readouterr().out


def test_a_traced_tensor_updated_alone_matches_the_measured_step():
    """The real steady-state step of a model whose untied 4096 x 300 embedding and head are each
    updated alone (1,228,800 values): the trace's optimizer phase is the metered one's."""
    from memtrain.analysis.trace import trace_step

    cfg = build_config(dict(vocab_size=4096, d_model=300, n_heads=2, n_layers=1, d_ff=64, max_seq_len=64,
                            untie_embeddings=True, device="cpu", precision="bf16-pure", dropout=0.0,
                            batch_size=1, seq_len=8))
    measured = measure_step_memory(cfg, 1)
    assert measured is not None
    traced = trace_step(cfg, "cpu")
    assert "optimizer_step" not in traced
    assert traced["phase_peaks"]["optimizer"] == pytest.approx(measured["phase_peaks"]["optimizer"], rel=0.001)
    assert _analytic(cfg).phase_peaks["optimizer"] == pytest.approx(measured["phase_peaks"]["optimizer"], rel=0.01)


def test_a_trace_of_bucketed_tensors_holds_their_copies_as_the_real_step():
    """Every tensor in a bucket: the trace holds the four copies and no eager temporaries, so it
    is no upper bound (no note) and its optimizer phase is the analytic one."""
    from memtrain.analysis.trace import trace_step

    cfg = _config("gpt-v97-d40")
    traced = trace_step(cfg, "cpu")
    assert "optimizer_step" not in traced
    assert traced["phase_peaks"]["optimizer"] == pytest.approx(_analytic(cfg).phase_peaks["optimizer"], rel=0.01)
    assert traced["peak_phase"] == "optimizer"


@pytest.mark.parametrize("optim,precision", [("adamw-8bit", "bf16-pure"), ("adamw-fused", "fp32"),
                                             ("adamw-8bit", "fp32")])
def test_a_step_without_scratch_holds_the_weights_gradients_and_state(optim, precision):
    """An optimizer step that adds no scratch still has its phase peak in the estimate: all that
    is live there (``phase_peaks`` of ``estimate --json``): the model state, the step's labels
    (1 x 8 int64, held until the step ends), its 0-d tensors (the float32 loss total and the
    previous step's gradient norm) and, before the step, clip_grad_norm_'s per-tensor norms and
    their stack (two values per gradient tensor, in the gradients' dtype)."""
    cfg = build_config(dict(SHAPES["gpt-v97-d40"], device="cpu", optim=optim, precision=precision, dropout=0.0,
                            batch_size=1, seq_len=8))
    est = estimate(cfg, device_type="cpu")
    state = est.extra["model_state"]
    assert state["optimizer_step_scratch"] == 0
    grads = [p for p in build_model(cfg, with_weights=False).parameters() if p.requires_grad]
    grad_bytes = 2 if precision == "bf16-pure" else 4
    scalars = 4 + grad_bytes + 2 * len(grads) * grad_bytes
    assert est.phase_peaks["optimizer"] == (state["weights"] + state["gradients"] + state["optimizer"] + 1 * 8 * 8
                                            + scalars)


def test_a_deep_models_buckets_are_planned_in_model_order():
    """The estimate lumps a deep model's middle blocks (one table entry standing for many); the
    buckets it plans over that table are those of the real model's tensors, in their order. At
    d_model 512 a block holds about 3.1M values, so buckets of at most 4M span blocks and the
    1024 x 512 FFN matrices sit at the threshold of being updated alone."""
    cfg = build_config(dict(vocab_size=97, d_model=512, n_heads=8, n_layers=12, d_ff=2048, max_seq_len=64,
                            device="cpu", precision="bf16-pure", dropout=0.0, batch_size=1, seq_len=8))
    with torch.device("meta"):
        scratch = _bucket_scratch(cfg)
    assert scratch > 4 * 2 * 3_000_000
    assert estimate(cfg, device_type="cpu").extra["model_state"]["optimizer_step_scratch"] == scratch


WIDE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            max_position_embeddings=64, vocab_size=384)


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma", "gpt2"])
def test_the_estimate_plans_the_buckets_of_each_familys_own_tensors(family, tmp_path):
    """The analytic table fuses q/k/v and gate/up; a transformers Llama, Qwen2 or Gemma holds them
    as separate Linears (Phi-3 and GPT-2 fused). At hidden 512 the fused gate/up (1.57M values)
    would be updated alone and the separate ones (786K each) in buckets: the estimate's scratch is
    that of the model's real tensors."""
    transformers = pytest.importorskip("transformers")
    make = {
        "llama": lambda: transformers.LlamaConfig(**WIDE, num_key_value_heads=2),
        "qwen2": lambda: transformers.Qwen2Config(**WIDE, num_key_value_heads=2),
        "phi3": lambda: transformers.Phi3Config(**WIDE, num_key_value_heads=2, pad_token_id=0),
        "gemma": lambda: transformers.GemmaConfig(**WIDE, num_key_value_heads=2, head_dim=64),
        "gpt2": lambda: transformers.GPT2Config(n_embd=512, n_layer=4, n_head=8, n_positions=64, vocab_size=384),
    }[family]
    make().save_pretrained(tmp_path)
    cfg = build_config({"model": str(tmp_path), "batch_size": 1, "seq_len": 8, "attention": "sdpa",
                        "device": "cpu", "precision": "bf16-pure"})
    with torch.device("meta"):
        scratch = _bucket_scratch(cfg)
    assert _analytic(cfg).extra["model_state"]["optimizer_step_scratch"] == scratch
